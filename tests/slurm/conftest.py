"""A real Slurm cluster of two fake nodes on this host, for the sbatch scripts.

``slurm/local/start_local_slurm.sh`` installs Debian's Slurm and munge when they are
missing (as root), writes its own ``slurm.conf`` (``/etc/slurm`` is left alone; clients
find it through ``SLURM_CONF``) and starts munged, slurmctld and one slurmd per node. A
cluster already running from the same directory (started by hand, or left by an
interrupted session) is used as it is and left running; otherwise the fixture stops
what it started, by PID, at the end of the session. Without root, or when the packages
cannot be installed, the tests are skipped with the reason.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SLURM_DIR = ROOT / "slurm"
LOCAL = SLURM_DIR / "local"
# The scripts' default (not a tmp dir): a cluster already running there is found by its
# PID files instead of clashing with a second one on the same ports.
BASE = Path(os.environ.get("LOCAL_SLURM_BASE", "/tmp/megatron-rl-local-slurm"))
NUM_NODES = 2


@dataclass
class Job:
    """A finished job as ``scontrol show job`` reported it."""

    job_id: str
    state: str
    exit_code: int
    stdout: str
    wait_rc: int


@dataclass
class LocalSlurm:
    env: dict[str, str]
    """Environment for Slurm clients and jobs: SLURM_CONF, and this interpreter's
    directory first on PATH so jobs run the same ``megatron-rl``."""

    def submit_and_wait(
        self, *args: str, env: dict[str, str] | None = None, timeout_s: int = 300,
        while_running: Callable[[str, Callable[[], bool]], None] | None = None,
    ) -> Job:  # fmt: skip
        """``sbatch_wait.sh ARGS`` (submit, poll until the job ends); the job's outcome.
        ``while_running(job_id, ended)`` is called once the job is submitted; ``ended()``
        tells it when the job has ended (a wait for something the job will never do stops
        there, with the job's outcome in the test's failure)."""
        proc = subprocess.Popen(
            [str(LOCAL / "sbatch_wait.sh"), *args],
            env={**self.env, **(env or {}), "SBATCH_WAIT_TIMEOUT": str(timeout_s)},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            first = proc.stderr.readline()
            if while_running is not None:
                submitted = re.search(r"submitted job (\d+)", first)
                assert submitted, f"sbatch_wait.sh did not submit: {first}"
                while_running(submitted.group(1), lambda: proc.poll() is not None)
            out, err = proc.communicate(timeout=timeout_s + 30)
        finally:
            if proc.poll() is None:
                proc.kill()
        err = first + err
        match = re.search(r"job (\d+) (\S+) exit=(\d+) stdout=(\S*)", err)
        assert match, f"sbatch_wait.sh gave no job summary (rc {proc.returncode}):\n{out}\n{err}"
        job_id, state, code, stdout_path = match.groups()
        stdout = Path(stdout_path).read_text() if stdout_path and Path(stdout_path).is_file() else ""
        return Job(job_id=job_id, state=state, exit_code=int(code), stdout=stdout, wait_rc=proc.returncode)


@pytest.fixture(scope="session")
def local_slurm():
    if os.geteuid() != 0:
        pytest.skip("the local Slurm cluster needs root (slurmd runs jobs as their users)")
    env = {**os.environ, "LOCAL_SLURM_BASE": str(BASE)}
    start = subprocess.run(
        [str(LOCAL / "start_local_slurm.sh"), str(NUM_NODES)], env=env, capture_output=True, text=True, timeout=900
    )
    if start.returncode == 3:  # no root, no apt-get, or the packages cannot be installed
        pytest.skip(f"no local Slurm cluster: {start.stderr.strip().splitlines()[-1]}")
    started_here = " started (pid" in start.stdout
    try:
        assert start.returncode == 0, f"start_local_slurm.sh failed:\n{start.stdout}\n{start.stderr}"
        job_env = {k: v for k, v in env.items() if not k.startswith(("SLURM_", "RAY_"))}
        job_env["SLURM_CONF"] = str(BASE / "etc" / "slurm.conf")
        job_env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        yield LocalSlurm(env=job_env)
    finally:
        if started_here or start.returncode != 0:
            subprocess.run([str(LOCAL / "stop_local_slurm.sh")], env=env, capture_output=True, timeout=120)
