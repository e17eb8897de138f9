"""Whether processes a test started are gone (zombies count as gone: dead, not yet reaped)."""

from __future__ import annotations

import time
from collections.abc import Iterable

import psutil

__all__ = ["alive", "wait_gone"]


def alive(pids: Iterable[int]) -> list[int]:
    """The PIDs among ``pids`` that are running."""
    running = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                running.append(pid)
        except psutil.NoSuchProcess:
            pass
    return running


def wait_gone(pids: Iterable[int], timeout_s: float = 30.0) -> list[int]:
    """Wait up to ``timeout_s`` for ``pids`` to end; returns those still running."""
    pids = list(pids)
    deadline = time.monotonic() + timeout_s
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    return alive(pids)
