"""One multi-rank job of an actor test worker over tiny HF models and their Megatron
conversions (tests/distributed/test_actor.py, test_lora.py, test_actor_scale.py,
test_actor_moe.py and test_packing.py share it). The ranks are torchrun's, forked by
``fork_ranks.py`` after the imports they share."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable
from pathlib import Path

from megatron_rl.models.convert.hf_mcore import HfToMcoreOptions, hf_to_mcore
from tests.helpers.jobs import run_job
from tests.helpers.tiny_hf import save_model

REPO = Path(__file__).resolve().parents[2]
FORK_RANKS = REPO / "tests" / "helpers" / "fork_ranks.py"


def run_actor_job(
    worker: Path, variants: Iterable[str], root: Path, *, timeout_s: int, nproc: int = 4
) -> tuple[list[dict], dict, Path]:
    """Save each variant (HF and converted Megatron checkpoint) under ``root``, run ``worker``
    on ``nproc`` ranks; every rank's JSON report (``out/rank{r}.json``), the job's spec and ``out``."""
    spec = {"variants": {}, "work_dir": str(root / "work")}
    for seed, variant in enumerate(variants):
        hf_dir = save_model(variant, root / variant, seed=seed)
        mcore_dir = root / f"{variant}_mcore"
        hf_to_mcore(HfToMcoreOptions(hf_dir=hf_dir, out_dir=mcore_dir))
        spec["variants"][variant] = {"hf_dir": str(hf_dir), "mcore_dir": str(mcore_dir)}
    out = root / "out"
    out.mkdir()
    (root / "spec.json").write_text(json.dumps(spec))
    cmd = [sys.executable, str(FORK_RANKS), str(nproc), str(worker), str(root / "spec.json"), str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = run_job(cmd, cwd=REPO, env=env, timeout_s=timeout_s)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-8000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)], spec, out
