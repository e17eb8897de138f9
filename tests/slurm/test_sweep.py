"""``megatron-rl sweep --launcher slurm`` on the real (local, two fake nodes) Slurm: each
run of 2 methods x 1 seed is its own ``slurm/train.sbatch`` job, the two run side by
side on the two nodes, and the sweep waits for both and writes the comparison."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from megatron_rl.observability import read_metrics
from tests.e2e.conftest import EXAMPLE, tiny_overrides

NUM_STEPS = 3


@pytest.fixture
def ray_env():
    """A small object store per Ray node (both fake nodes advertise the host's memory)."""
    return {"MEGATRON_RL_RAY_OBJECT_STORE_BYTES": str(200 * 2**20), "MEGATRON_RL_RAY_WAIT_S": "120"}


def test_sweep_runs_each_method_as_a_job(local_slurm, tmp_path, ray_env):
    out = tmp_path / "sweep"
    overrides = tiny_overrides(tmp_path / "unused", f"trainer.num_steps={NUM_STEPS}", "trainer.eval_every_steps=0",
                               "trainer.save_every_steps=0", "trainer.save_final=false")  # fmt: skip
    sbatch_args = f"--nodes=1 --gpus-per-node=0 --time=10 --chdir={tmp_path}"
    cmd = [sys.executable, "-m", "megatron_rl", "sweep", str(EXAMPLE), *overrides, "--methods", "grpo,ar",
           "--seeds", "1", "--out", str(out), "--launcher", "slurm", f"--sbatch-args={sbatch_args}",
           "--poll-s", "1", "--threshold", "0.0"]  # fmt: skip
    proc = subprocess.run(cmd, env={**local_slurm.env, **ray_env}, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-6000:]

    jobs = re.findall(r"(grpo|ar) seed 1234: job (\d+)", proc.stderr)
    assert [m for m, _ in jobs] == ["grpo", "ar"] and jobs[0][1] != jobs[1][1], proc.stderr
    for method, job_id in jobs:
        assert f"job {job_id} ({method} seed 1234): COMPLETED, exit 0" in proc.stderr
        log = (out / "logs" / f"{method}_seed1234-{job_id}.log").read_text()
        assert "the trainer exited with code 0" in log and "Ray stopped" in log, log[-4000:]
        records = read_metrics(out / method / "seed1234")
        assert [r["step"] for r in records] == list(range(1, NUM_STEPS + 1))
        assert ("loss/ar/weight_mean" in records[0]) == (method == "ar")
    payload = json.loads((out / "comparison.json").read_text())
    assert [m["method"] for m in payload["methods"]] == ["grpo", "ar"]
    assert (out / "comparison.png").is_file() and "| ar | 1 |" in (out / "comparison.md").read_text()
