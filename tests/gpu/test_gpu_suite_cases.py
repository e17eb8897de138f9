"""benchmarks/gpu_suite.py's cases (``benchmarks/gpu_suite_cases.py``) on a CUDA device, at toy
sizes (``--tiny --device cuda``).

Skipped without a CUDA device (tests/conftest.py). The full-size suite is a benchmark, not
a test (docs/gpu.md: about 8 minutes on an H100); this runs every case's GPU code path
(CUDA events, NCCL world-1 group, peak-memory bookkeeping, the actor and the HF engine on
the device) in well under a minute and checks the numbers are there and finite, and that
the float32 actor's log-probs on the GPU match a float64 CPU forward.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

from tests.helpers.jobs import run_job

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[2]


def test_every_case_runs_on_cuda(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    cmd = [
        sys.executable,
        str(REPO / "benchmarks" / "gpu_suite.py"),
        "--tiny",
        "--device",
        "cuda",
        "--out",
        str(tmp_path),
    ]
    proc = run_job(cmd, cwd=REPO, env=env, timeout_s=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    records = [json.loads(line) for line in (tmp_path / "gpu_suite.jsonl").read_text().splitlines()]
    for case in ("loss", "linear", "actor", "engine", "logprob"):
        ok = [r for r in records if r["case"] == case and r["status"] == "ok"]
        assert ok, case
        assert all(r["device"].startswith("cuda") for r in ok)
    for r in records:
        if r["case"] in ("loss", "linear") and r["status"] == "ok" and "fwd_bwd_s" in r:
            assert r["fwd_bwd_s"] > 0 and r["peak_extra_bytes"] > 0  # CUDA events and the allocator's peak
    actor = next(r for r in records if r["case"] == "actor" and r.get("spec") == "local")
    assert math.isfinite(actor["loss"]) and actor["tokens_per_s"] > 0
    fp32 = next(r for r in records if r["case"] == "logprob" and r["actor_dtype"] == "float32")
    assert fp32["max_abs_dlogp"] < 1e-3
