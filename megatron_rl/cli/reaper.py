"""Clean up after a driver that dies without cleaning up itself (``kill -9``, the OOM killer).

``megatron-rl train`` starts this as a small detached process (:func:`start`) watching the
driver's PID. While the driver lives, it records the driver's descendants (PID and start
time, so a reused PID is never touched) once a second. Once the driver is gone it sends
SIGTERM to every recorded process still alive and to their own descendants, SIGKILL to
whatever is left a second later, and exits: no process of the run outlives its driver
by more than about three seconds. On a normal exit the driver has stopped Ray and the
reward workers already and there is nothing left to do.

What it reaps is what the driver started: with a local ``ray.init`` that is Ray itself
(GCS, raylet, workers, agents; Ray's agents otherwise linger for a minute or more); a
Ray cluster the driver only joins (``RAY_ADDRESS``, Slurm) is not the driver's, and Ray
ends the job's actors there. The reward workers also die with their parent on their own
(``rewards/pool.py``); this is the net under everything else. Files a reaped process left
in ``/dev/shm`` are removed too: the run's processes name theirs
``megatron_rl_<kind>_<pid>_<suffix>`` (the ``shared_memory`` weight transport's file,
``weight_sync/transports/shm.py``).

Linux only (it reads ``/proc``); elsewhere :func:`start` starts nothing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from megatron_rl.cluster.processes import descendants, process_start_time, signal_all

__all__ = ["leftover_shm_files", "start"]

_PROC = Path("/proc")
_SHM = Path("/dev/shm")
_POLL_S = 1.0
_GRACE_S = 1.0


def leftover_shm_files(pids: set[int], directory: Path = _SHM) -> list[Path]:
    """The files ``megatron_rl_<kind>_<pid>_<suffix>`` in ``directory`` of processes ``pids``."""
    if not directory.is_dir():
        return []
    found = []
    for path in directory.glob("megatron_rl_*_*_*"):
        owner = path.name.rsplit("_", 2)[-2]
        if owner.isdigit() and int(owner) in pids:
            found.append(path)
    return found


def watch(driver: int, driver_start: int) -> None:
    """Record ``driver``'s descendants until it exits, then end them (see the module doc)."""
    me = os.getpid()
    seen: dict[int, int] = {}
    while process_start_time(driver) == driver_start:
        seen.update(descendants({driver}))
        seen.pop(me, None)
        time.sleep(_POLL_S)
    # Processes started since the last look are still children of recorded ones.
    seen.update(descendants(set(seen)))
    seen.pop(me, None)
    if signal_all(seen, signal.SIGTERM):
        deadline = time.monotonic() + _GRACE_S
        while time.monotonic() < deadline and any(process_start_time(p) == s for p, s in seen.items()):
            time.sleep(0.05)
        signal_all(seen, signal.SIGKILL)
    for path in leftover_shm_files({driver, *seen}):
        path.unlink(missing_ok=True)


def start(pid: int | None = None) -> subprocess.Popen | None:
    """Start the reaper for process ``pid`` (default: this one); ``None`` where ``/proc`` is missing."""
    pid = os.getpid() if pid is None else pid
    started = process_start_time(pid) if _PROC.is_dir() else None
    if started is None:
        return None
    # Its own session: a signal to the driver's process group (Ctrl-C, killpg) must not
    # take the reaper with it.
    return subprocess.Popen(
        [sys.executable, "-m", "megatron_rl.cli.reaper", str(pid), str(started)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True, close_fds=True,
    )  # fmt: skip


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watch(int(sys.argv[1]), int(sys.argv[2]))
