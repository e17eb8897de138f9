"""Telling a live process from a new one that reuses its pid: the start time the kernel
records for each process (``/proc/PID/stat``), compared with the one seen earlier. Used by
the reaper (``cli/reaper.py``) and the run directory's lock (``loop/run_lock.py``).

Linux only (it reads ``/proc``).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["process_start_time"]

_PROC = Path("/proc")


def process_start_time(pid: int) -> int | None:
    """The start time of ``pid`` (clock ticks after boot), or ``None`` if it is gone or a zombie."""
    try:
        fields = (_PROC / str(pid) / "stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])
