"""One run per run directory (``loop.run_lock``): the lock, its holder record, re-entrancy,
a dead holder's lock, and the record-only fallback of a file system without ``flock``."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import subprocess
import sys
import textwrap

import pytest

from megatron_rl.loop import run_lock
from megatron_rl.loop.run_lock import LOCK_FILE, RunDirInUseError, lock_run_dir

pytestmark = pytest.mark.unit

_HOLD = textwrap.dedent("""
    import sys, time
    from megatron_rl.loop.run_lock import lock_run_dir
    lock_run_dir(sys.argv[1])
    print("held", flush=True)
    time.sleep(120)
""")


@pytest.fixture
def holder(tmp_path):
    """Another process holding ``tmp_path/run``."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path / "run")], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    yield proc
    proc.kill()
    proc.wait()


def test_a_live_holder_refuses_a_second_run_naming_the_directory_and_the_holder(tmp_path, holder):
    with pytest.raises(RunDirInUseError) as e:
        lock_run_dir(tmp_path / "run")
    assert f"the run directory {tmp_path / 'run'} is in use by another run (pid {holder.pid} on host" in str(e.value)
    assert "logging.run_name" in str(e.value)
    record = json.loads((tmp_path / "run" / LOCK_FILE).read_text())
    assert record["pid"] == holder.pid  # the refused attempt did not overwrite the record


def test_the_lock_of_a_killed_holder_is_free_at_once(tmp_path, holder):
    holder.kill()
    holder.wait()
    with lock_run_dir(tmp_path / "run") as lock:
        assert json.loads(lock.path.read_text())["pid"] == os.getpid()


def test_the_lock_is_reentrant_in_one_process_and_released_by_the_last_hold(tmp_path):
    first = lock_run_dir(tmp_path / "run")
    second = lock_run_dir(tmp_path / "run")
    assert second is first and first.count == 2
    second.release()
    probe = os.open(first.path, os.O_RDWR)
    try:
        with pytest.raises(BlockingIOError):  # still held after one release
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        first.release()
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free now
    finally:
        os.close(probe)


def test_without_flock_the_record_decides(tmp_path, monkeypatch, holder):
    # A file system without locks answers flock with ENOLCK (the real errno, at the lowest level).
    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(run_lock.fcntl, "flock", no_locks)
    with pytest.raises(RunDirInUseError, match="this file system has no locks"):
        lock_run_dir(tmp_path / "run")  # the holder's process runs
    holder.kill()
    holder.wait()
    with lock_run_dir(tmp_path / "run") as lock:  # its record is stale now: replaced
        assert json.loads(lock.path.read_text())["pid"] == os.getpid()
    # A holder on another host cannot be checked: taken as alive, the message says what to delete.
    record = json.loads((tmp_path / "run" / LOCK_FILE).read_text())
    (tmp_path / "run" / LOCK_FILE).write_text(json.dumps({**record, "pid": 1, "host": "elsewhere"}))
    with pytest.raises(RunDirInUseError, match=f"delete {tmp_path / 'run' / LOCK_FILE}"):
        lock_run_dir(tmp_path / "run")
