"""One run per run directory: an exclusive lock held by the driver for the whole run.

Two launches into one ``trainer.output_dir / logging.run_name`` would write the same
metrics file, ``config.yaml`` and checkpoint names. The driver holds an ``flock`` on
``RUN_DIR/run.lock`` from the end of the pre-flight until it exits; the kernel drops the
lock when the process dies, however it dies, so a lock left by a dead run is never in
the way. The file also names its holder (pid, host, start time, command), which the
error of a second launch repeats. On a file system without ``flock`` (some network
mounts answer ``ENOLCK``), the holder record alone decides: a holder on this host whose
process is gone (pid and start time) is stale and replaced; a holder on another host is
taken as alive, and the error says which file to delete once that run is known to be over.

Within one process the lock is re-entrant (the CLI takes it before building the run,
``build_run`` takes it again), since a second ``flock`` on a new descriptor of the same
file would refuse its own process.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_rl.cluster.processes import process_start_time

__all__ = ["LOCK_FILE", "RunDirInUseError", "RunDirLock", "lock_run_dir"]

LOCK_FILE = "run.lock"
"""``RUN_DIR/run.lock``: held by the run's driver; its content names the holder."""

_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}
"""``flock`` errors of a file system that has no locks (as opposed to a held lock)."""


class RunDirInUseError(RuntimeError):
    """Another live run holds the run directory; the message names it and the holder."""


def _holder_record() -> dict:
    pid = os.getpid()
    return {"pid": pid, "host": socket.gethostname(), "proc_start_ticks": process_start_time(pid),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(sys.argv)[:300]}  # fmt: skip


def _describe(holder: dict) -> str:
    if not holder:
        return "a process whose record is not written yet"
    return (f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')}: "
            f"{holder.get('command') or '?'}")  # fmt: skip


def _holder_is_gone(holder: dict) -> bool:
    """Whether the record names a process of this host that no longer runs (a stale record)."""
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return False
    ticks = process_start_time(holder["pid"])
    return ticks is None or ticks != holder.get("proc_start_ticks")


@dataclass
class RunDirLock:
    """The held lock of one run directory (see :func:`lock_run_dir`)."""

    path: Path
    fd: int
    count: int = 1

    def release(self) -> None:
        """Drop one hold; the last one unlocks and closes the file (the record stays: it is
        only read while the lock is held or to explain a refusal)."""
        self.count -= 1
        if self.count > 0:
            return
        _HELD.pop(self.path, None)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        except OSError:
            pass
        os.close(self.fd)

    def __enter__(self) -> RunDirLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


_HELD: dict[Path, RunDirLock] = {}
"""The locks this process holds, by lock file path (re-entrancy)."""


def lock_run_dir(run_dir: str | os.PathLike) -> RunDirLock:
    """Take the run directory (created if missing) for this process; raises
    :class:`RunDirInUseError` naming the directory and the holder if another live run has it."""
    run_dir = Path(run_dir)
    path = (run_dir / LOCK_FILE).resolve()
    if path in _HELD:
        _HELD[path].count += 1
        return _HELD[path]
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _acquire(fd, path, run_dir)
        record = json.dumps(_holder_record()).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, record, 0)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        raise
    _HELD[path] = lock = RunDirLock(path, fd)
    return lock


def _read_holder(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 65536, 0) or b"{}")
    except ValueError:
        return {}


def _acquire(fd: int, path: Path, run_dir: Path) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return
    except BlockingIOError:
        holder = _read_holder(fd)
        raise RunDirInUseError(
            f"the run directory {run_dir} is in use by another run ({_describe(holder)}); wait for it "
            "to end or stop it, or give this run another logging.run_name (or trainer.output_dir)"
        ) from None
    except OSError as e:
        if e.errno not in _NO_FLOCK:
            raise
    # No flock on this file system: the record decides.
    holder = _read_holder(fd)
    if holder and holder.get("pid") != os.getpid() and not _holder_is_gone(holder):
        raise RunDirInUseError(
            f"the run directory {run_dir} is in use by another run ({_describe(holder)}; this file "
            f"system has no locks, so that is what {path} says); if that run is over, delete {path}"
        )
