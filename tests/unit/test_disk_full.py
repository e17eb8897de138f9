"""A full disk is named as such (``storage.durable.DiskFullError``): the metrics sink on a
device that answers every write with the real ``ENOSPC`` (``/dev/full``), and the
recognition of a full disk behind wrapped errors."""

from __future__ import annotations

import errno
import os
import pickle
import subprocess

import pytest

from megatron_rl.observability import MetricsSink, read_metrics
from megatron_rl.storage.durable import DiskFullError, disk_full

pytestmark = pytest.mark.unit


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs Linux's /dev/full")
def test_a_metrics_write_on_a_full_disk_names_the_file_and_the_close_is_quiet(tmp_path):
    (tmp_path / "metrics.jsonl").symlink_to("/dev/full")  # every write: ENOSPC, from the kernel
    sink = MetricsSink(tmp_path)
    with pytest.raises(DiskFullError) as e:
        sink.log(3, {"loss": 1.0})
    assert e.value.errno == errno.ENOSPC
    assert str(e.value).startswith(f"no space left on the device of {tmp_path / 'metrics.jsonl'} while writing "
                                   "the metrics of step 3")  # fmt: skip
    sink.close()  # nothing buffered to write again


def _mount_tmpfs(path, size_bytes: int) -> bool:
    path.mkdir()
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0  # fmt: skip


def test_a_disk_that_fills_mid_line_leaves_only_whole_lines(tmp_path):
    mount = tmp_path / "small"
    if not _mount_tmpfs(mount, 8192):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        sink = MetricsSink(mount)
        logged = 0
        with pytest.raises(DiskFullError):
            for step in range(1, 1000):  # ~300-byte lines: the 8 KiB fill up mid-line
                sink.log(step, {f"metric/{i}": float(i) for i in range(12)})
                logged = step
        sink.close()
        text = (mount / "metrics.jsonl").read_text()
        assert text.endswith("\n") and [r["step"] for r in read_metrics(mount)] == list(range(1, logged + 1))
    finally:
        subprocess.run(["umount", str(mount)], check=True)


class _Wrapped(Exception):
    """Stands for Ray's wrapper of an actor's error (which keeps it as ``cause``)."""

    def __init__(self, cause: BaseException):
        super().__init__("ray::ActorWorker.save_checkpoint() failed")
        self.cause = cause


def test_a_full_disk_is_found_behind_causes_and_wrappers():
    full = OSError(errno.ENOSPC, "No space left on device")
    quota = OSError(errno.EDQUOT, "Disk quota exceeded")
    try:
        try:
            raise full
        except OSError as inner:
            raise RuntimeError("unexpected pos 704 vs 598") from inner
    except RuntimeError as outer:
        chained = outer
    assert disk_full(chained) and disk_full(_Wrapped(quota)) and disk_full(DiskFullError("/x", "y"))
    assert not disk_full(RuntimeError("unexpected pos 704 vs 598")) and not disk_full(OSError(errno.EIO, "I/O"))


def test_the_error_crosses_process_boundaries_whole():
    # Raised in an actor rank, it reaches the driver pickled (Ray): same type, message and errno.
    error = DiskFullError("/runs/x/checkpoints", "the checkpoint step_000002")
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is DiskFullError and str(again) == str(error) and again.errno == errno.ENOSPC


def test_a_full_disk_at_start_is_refused_before_anything_starts(tmp_path, capsys):
    """A full file system passes the write test (an empty file needs no block): the
    pre-flight checks the free space too, and the CLI exits 2 naming the field."""
    from megatron_rl.cli import main
    from tests.e2e.conftest import EXAMPLE, tiny_overrides

    mount = tmp_path / "small"
    if not _mount_tmpfs(mount, 1 << 20):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        with open(mount / "filler", "wb") as f:
            with pytest.raises(OSError):
                while True:
                    f.write(b"\0" * (64 << 10))
                    f.flush()
        assert main(["train", str(EXAMPLE), *tiny_overrides(mount / "out"), "--dry-run"]) == 2
        error = capsys.readouterr().err
        assert f"error: config field 'trainer.output_dir': the file system of {mount} is full (0 KiB free" in error
        assert not (mount / "out").exists()
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)
