"""Telling a live process from a new one that reuses its pid: the start time the kernel
records for each process (``/proc/PID/stat``), compared with the one seen earlier; a
process's descendants, each with its start time, and signalling them so that a reused pid
is never hit. Used by the reaper (``cli/reaper.py``), the run directory's lock
(``loop/run_lock.py``), a failed local Ray start's clean-up (``cluster/local_ray.py``) and
the Slurm scripts' waits for Ray (``slurm/ray_on_slurm.sh``).

Linux only (it reads ``/proc``).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["descendants", "process_start_time", "signal_all"]

_PROC = Path("/proc")


def process_start_time(pid: int) -> int | None:
    """The start time of ``pid`` (clock ticks after boot), or ``None`` if it is gone or a zombie."""
    try:
        fields = (_PROC / str(pid) / "stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _parents() -> dict[int, tuple[int, int]]:
    """``{pid: (parent pid, start time)}`` of every live process."""
    table = {}
    for entry in _PROC.iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue  # exited while we looked
            if fields[0] not in ("Z", "X"):
                table[int(entry.name)] = (int(fields[1]), int(fields[19]))
    return table


def descendants(roots: set[int], table: dict[int, tuple[int, int]] | None = None) -> dict[int, int]:
    """``{pid: start time}`` of every live descendant of the processes ``roots``."""
    table = _parents() if table is None else table
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found: dict[int, int] = {}
    stack = list(roots)
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in found:
                found[child] = table[child][1]
                stack.append(child)
    return found


def signal_all(processes: dict[int, int], sig: int) -> int:
    """Send ``sig`` to each ``{pid: start time}`` that is still that process; how many got it."""
    sent = 0
    for pid, started in processes.items():
        if process_start_time(pid) == started:
            try:
                os.kill(pid, sig)
                sent += 1
            except OSError:
                pass
    return sent
