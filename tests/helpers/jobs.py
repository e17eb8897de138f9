"""Run a multi-process job (torchrun, a CLI run with Ray) so that nothing outlives it.

The job starts in a new session (its own process group); when it times out, fails, or
the test is interrupted (pytest-timeout, Ctrl-C), the whole group is killed, ranks and
their children included. ``subprocess.run(timeout=...)`` kills only the direct child:
a 4-rank torchrun job left behind that way kept spinning the CI machine's 2 cores.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["kill_group", "run_job"]


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL every process of ``proc``'s process group (a no-op once it is gone)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_job(
    cmd: Sequence[str], *, timeout_s: float, cwd: str | Path | None = None, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)`` in a process group of its own,
    killed whole on a time-out (then ``TimeoutExpired`` is raised as usual), on any other
    exception, and after the job exits (stragglers it left behind)."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=None if env is None else dict(env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except BaseException:
        kill_group(proc)
        proc.communicate()
        raise
    kill_group(proc)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
