"""The actor with the Transformer-Engine spec on CUDA: bf16, and FP8 on Hopper or later.

Skipped without a CUDA device (tests/conftest.py) or without ``transformer_engine``.
Runs tests/helpers/actor_te_worker.py under torchrun on up to 2 GPUs (TP = GPU count):

* TE layers are in use; bf16 log-probs match a float32 transformers forward to bf16
  accuracy; a train step moves the weights; a checkpoint reloads with identical log-probs
  (optimizer state included); ``iter_hf_weights`` covers the HF state dict;
* FP8 (hybrid, delayed scaling) train step is finite, and two forward-only passes after it
  give identical log-probs: they leave the delayed scaling state frozen (compute
  capability >= 9). Never run: the lent GPU machines have no Transformer Engine.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.jobs import run_job
from tests.helpers.tiny_hf import save_model

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "helpers" / "actor_te_worker.py"


def test_actor_with_transformer_engine(tmp_path):
    pytest.importorskip("transformer_engine")
    gpus = min(2, torch.cuda.device_count())
    hf_dir = save_model("qwen2_gqa", tmp_path / "hf")
    spec = {"hf_dir": str(hf_dir), "work_dir": str(tmp_path / "work"), "tp": gpus}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(gpus),
           str(WORKER), str(tmp_path / "spec.json"), str(tmp_path)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = run_job(cmd, cwd=REPO, env=env, timeout_s=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-8000:]
    report = json.loads((tmp_path / "report.json").read_text())
    print(json.dumps(report, indent=2))

    assert report["spec"].startswith("TE")
    assert report["bf16_logp_vs_hf"] <= 0.1  # bf16 weights and activations vs a float32 forward
    step = report["bf16_step"]
    assert step["actor/step_skipped"] == 0.0 and math.isfinite(step["loss/total"]) and math.isfinite(step["actor/grad_norm"])
    assert report["bf16_logp_moved"] > 1e-3
    assert report["reload_loaded_optimizer"] and report["reload_logp_diff"] == 0.0
    assert report["hf_names"] == sorted(load_file(hf_dir / "model.safetensors"))
    if torch.cuda.get_device_capability()[0] >= 9:
        fp8 = report["fp8_step"]
        assert fp8["actor/step_skipped"] == 0.0 and math.isfinite(fp8["loss/total"])
        assert report["fp8_repeat_logp_diff"] == 0.0  # the scales did not move between the passes
