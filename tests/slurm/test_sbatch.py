"""slurm/train.sbatch and slurm/convert.sbatch on a real (local, two fake nodes) Slurm.

One training job runs the tiny CPU demo over two Ray nodes with 2 actor ranks (DP=2)
and 2 engines spread over the nodes, and must leave metrics, a checkpoint and a
placement that uses both nodes; Ray must be stopped by the job itself. A job whose
trainer fails must end FAILED with the trainer's exit code.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from megatron_rl.storage.checkpoints import read_latest
from tests.e2e.conftest import tiny_overrides
from tests.helpers.runs import logged_steps
from tests.helpers.slow_ray_head import slow_first_head_agent
from tests.slurm.conftest import ROOT, SLURM_DIR

EXAMPLE = ROOT / "examples" / "tiny_cpu.yaml"


@pytest.fixture
def ray_env():
    """Job settings: a small object store per Ray node (both fake nodes advertise the
    host's memory) and a Ray temp dir of the test's own (short: it holds Unix sockets),
    removed afterwards."""
    tmp = tempfile.mkdtemp(prefix="mrlray-", dir="/tmp")
    yield {
        "MEGATRON_RL_RAY_OBJECT_STORE_BYTES": str(200 * 2**20),
        "MEGATRON_RL_RAY_WAIT_S": "120",
        "MEGATRON_RL_RAY_TMPDIR": tmp,
    }
    shutil.rmtree(tmp, ignore_errors=True)


def sbatch_args(tmp_path: Path, script: str, *, nodes: int = 2) -> list[str]:
    """Flags that fit the CPU-only test cluster (no GPUs, small memory) around ``script``."""
    return [
        f"--nodes={nodes}", "--gpus-per-node=0", f"--chdir={tmp_path}", f"--output={tmp_path}/job-%j.out",
        "--time=10", str(SLURM_DIR / script),
    ]  # fmt: skip


def train_overrides(tmp_path: Path, *extra: str) -> list[str]:
    return tiny_overrides(
        tmp_path / "runs", "logging.run_name=slurm", "trainer.num_steps=3", "trainer.eval_every_steps=0",
        "parallel.num_actor_ranks=2", "rollout.num_engines=2", "parallel.ray_scheduling=spread", *extra,
    )  # fmt: skip


def ray_processes_of(address: str) -> list[str]:
    """Command lines of live processes that belong to the Ray cluster at ``address``."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if address in cmdline and state != "Z":
            found.append(f"{proc.name}: {cmdline[:200]}")
    return found


def test_train_over_two_nodes(local_slurm, tmp_path, ray_env):
    job = local_slurm.submit_and_wait(
        *sbatch_args(tmp_path, "train.sbatch"), str(EXAMPLE), *train_overrides(tmp_path), env=ray_env
    )
    assert (job.state, job.exit_code, job.wait_rc) == ("COMPLETED", 0, 0), job.stdout[-6000:]

    run_dir = tmp_path / "runs" / "slurm"
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    assert (run_dir / "checkpoints" / "latest").exists()
    assert list((run_dir / "checkpoints").glob("step_*3"))

    # Both Ray nodes ran work: spread scheduling put ranks and engines on both.
    placement = json.loads((run_dir / "placement.json").read_text())
    assert len(placement["nodes"]) == 2, placement
    used = placement["actor_ranks"] + placement["engines"]
    assert set(used) <= set(placement["nodes"]), placement
    assert len(set(placement["actor_ranks"])) == 2, placement
    assert len(set(placement["engines"])) == 2, placement

    # Ray was stopped by the job: each node task logged its clean stop, and no process of
    # that cluster is left on the host.
    address = re.search(r"Ray head on \S+ at (\S+);", job.stdout).group(1)
    logs = sorted(tmp_path.glob(f"ray-{job.job_id}-*.log"))
    assert len(logs) == 2, logs
    for log in logs:
        assert "] stopped" in log.read_text(), log.read_text()[-3000:]
    # (A Ray worker process can take a moment to notice its raylet is gone.)
    deadline = time.monotonic() + 15
    while ray_processes_of(address) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray_processes_of(address) == []
    # ... and no pointer to it that a later plain ray.init() on the host would follow.
    assert not (Path(ray_env["MEGATRON_RL_RAY_TMPDIR"]) / "ray_current_cluster").exists()
    default_pointer = Path("/tmp/ray/ray_current_cluster")
    assert not (default_pointer.exists() and address in default_pointer.read_text())


def test_trainer_failure_fails_the_job(local_slurm, tmp_path, ray_env):
    # A missing data file: the trainer exits 2 after the Ray cluster is up. This job also
    # takes the fixed-port path (per-node offsets, as when fake nodes share a host), below
    # the kernel's ephemeral range (32768..) so no outgoing connection can hold one of them.
    # And its Ray head misses Ray's start-up deadline once (as on a busy machine): ray_node.sh
    # starts it again on the same GCS port before any worker joins.
    slow_env, marker = slow_first_head_agent(tmp_path)
    # (Each failed try takes Ray's own 30 s or more on a busy machine: the default wait.)
    env = {**ray_env, "MEGATRON_RL_RAY_NODE_PORT_BASE": "21000", "MEGATRON_RL_RAY_PORT_STRIDE": "1000",
           "MEGATRON_RL_RAY_WAIT_S": "300",
           "MRL_TEST_SLOW_AGENT_MARKER": slow_env["MRL_TEST_SLOW_AGENT_MARKER"],
           "PYTHONPATH": os.pathsep.join(p for p in (slow_env["PYTHONPATH"], os.environ.get("PYTHONPATH")) if p)}  # fmt: skip
    missing = tmp_path / "no_such_train.jsonl"
    job = local_slurm.submit_and_wait(
        *sbatch_args(tmp_path, "train.sbatch"), str(EXAMPLE),
        *train_overrides(tmp_path, f"data.train_files=[{missing}]"), env=env, timeout_s=600,
    )  # fmt: skip
    ray_logs = "".join(f"\n--- {log.name}\n{log.read_text()[-3000:]}" for log in sorted(tmp_path.glob("ray-*.log")))
    assert (job.state, job.exit_code) == ("FAILED", 2), job.stdout[-6000:] + ray_logs
    assert job.wait_rc == 2
    assert ":21000; workers on" in job.stdout  # the GCS port follows the fixed base
    assert str(missing) in job.stdout
    assert "all 2 Ray nodes are alive" in job.stdout
    assert "Ray stopped" in job.stdout
    assert marker.exists(), "the head's first dashboard agent was not slowed: the retry was not tested"
    assert "warning: the Ray head exited with code 1 before it came up (try 1 of 3)" in job.stdout
    # the slowed agent, still asleep when its try failed, was killed before the next try
    head_log = next(log for log in tmp_path.glob("ray-*.log") if " --head " in log.read_text())
    assert "killing what try 1 left: " in head_log.read_text(), head_log.read_text()[-3000:]


def test_slurms_early_warning_stops_the_run_with_a_checkpoint(local_slurm, tmp_path, ray_env):
    """``--signal=B:USR1@300``: Slurm signals the batch shell only; the script forwards it to
    the driver, which finishes its step, checkpoints it and exits 3; Ray is stopped."""
    run_dir = tmp_path / "runs" / "slurm"

    def warn_when_two_steps_are_logged(job_id: str, ended) -> None:
        deadline = time.monotonic() + 400
        while not ((run_dir / "metrics.jsonl").exists() and len(logged_steps(run_dir)) >= 2):
            assert time.monotonic() < deadline, "the job logged no two steps"
            if ended():
                out = tmp_path / f"job-{job_id}.out"  # sbatch_args' --output
                pytest.fail(f"job {job_id} ended before it logged two steps:\n{out.read_text()[-6000:] if out.exists() else ''}")
            time.sleep(0.2)
        subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], env=local_slurm.env, check=True)

    job = local_slurm.submit_and_wait(
        *sbatch_args(tmp_path, "train.sbatch"), str(EXAMPLE),
        *train_overrides(tmp_path, "trainer.num_steps=400", "trainer.save_every_steps=0"), env=ray_env,
        timeout_s=600, while_running=warn_when_two_steps_are_logged,
    )  # fmt: skip
    last = logged_steps(run_dir)[-1]
    assert (job.state, job.exit_code) == ("FAILED", 3), job.stdout[-6000:]
    assert f"stopped: SIGUSR1 after step {last} (checkpoint" in job.stdout, job.stdout[-6000:]
    assert read_latest(run_dir / "checkpoints").name == f"step_{last:06d}"
    assert logged_steps(run_dir) == list(range(1, last + 1)) and last < 400
    assert "Ray stopped" in job.stdout


def test_convert_job(local_slurm, tmp_path):
    from tests.helpers.tiny_hf import save_model, save_tokenizer

    hf = save_model("qwen2_gqa", tmp_path / "hf")
    save_tokenizer(hf)
    out = tmp_path / "mcore"
    # The script asks for 8 CPUs and 64G, more than a fake node has.
    args = ["--cpus-per-task=2", "--mem=1G", *sbatch_args(tmp_path, "convert.sbatch", nodes=1)]
    job = local_slurm.submit_and_wait(
        *args, "hf-to-mcore", "--hf", str(hf), "--out", str(out), "--tp", "2", timeout_s=300
    )
    assert (job.state, job.exit_code) == ("COMPLETED", 0), job.stdout[-4000:]
    assert (out / "metadata.json").is_file()
    bad = local_slurm.submit_and_wait(
        *args, "hf-to-mcore", "--hf", str(tmp_path / "nowhere"), "--out", str(tmp_path / "mcore2"), timeout_s=300
    )
    assert bad.state == "FAILED" and bad.exit_code != 0, bad.stdout[-4000:]


@pytest.mark.parametrize("script", ["train.sbatch", "convert.sbatch"])
def test_scripts_are_executable_and_strict(script):
    path = SLURM_DIR / script
    assert os.access(path, os.X_OK)
    assert "set -euo pipefail" in path.read_text()
