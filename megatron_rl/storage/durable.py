"""Durable writes: data is on disk before a rename makes it visible.

A power cut must not leave a ``latest`` pointer naming a checkpoint whose files are still
in the page cache, nor a metrics file replaced by an empty one. Standard library only.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

__all__ = ["DiskFullError", "disk_full", "fsync_dir", "fsync_file", "write_text_durable"]

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
"""No space left on the device, disk quota exceeded."""


class DiskFullError(OSError):
    """A write failed because the file system of ``path`` is full (or over quota); the
    message names the path and what was being written."""

    def __init__(self, path: str | os.PathLike, what: str):
        super().__init__(errno.ENOSPC, f"no space left on the device of {path} while writing {what}; free space (or "
                         "point trainer.output_dir elsewhere), then rerun the same command to resume from the last "
                         "checkpoint", str(path))  # fmt: skip
        self.what = what

    def __reduce__(self):  # OSError pickles as OSError(errno, strerror, filename): not this signature
        return type(self), (self.filename, self.what)

    def __str__(self) -> str:
        return self.strerror


def disk_full(exc: BaseException | None) -> bool:
    """Whether ``exc`` or an exception it was raised from (``__cause__``/``__context__``,
    Ray's ``cause``) is a full disk or quota."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS:
            return True
        exc = getattr(exc, "cause", None) or exc.__cause__ or exc.__context__
    return False


def fsync_file(path: str | os.PathLike) -> None:
    """Flush ``path``'s data to disk (an fd opened read-only suffices on Linux)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush directory ``path`` (its entries: files created or renamed in it) to disk."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # a platform that cannot open directories (Windows): nothing to do
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def write_text_durable(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` atomically and durably: a temporary file, fsync, rename, fsync
    of the directory. A reader (or a crash) sees the old or the new content, never a part."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
