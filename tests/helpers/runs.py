"""Watching a ``megatron-rl train`` run from outside, as a user's shell would: the steps it
logged, the processes it started and whether they are gone. Shared by the end-to-end
tests and ``tools/reliability_campaign.py``."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from megatron_rl.cluster.processes import descendants, process_start_time
from megatron_rl.observability import read_metrics

__all__ = ["alive", "cmdline", "descendants", "logged_steps", "wait_for_steps", "wait_tree_gone"]


def logged_steps(run_dir: Path) -> list[int]:
    """The steps in ``RUN_DIR/metrics.jsonl``, in file order (``[]`` before the first)."""
    return [r["step"] for r in read_metrics(run_dir)] if (run_dir / "metrics.jsonl").exists() else []


def wait_for_steps(proc: subprocess.Popen, run_dir: Path, n: int, timeout_s: float = 600) -> None:
    """Wait until the run has logged ``n`` steps; fails if it ends (or takes ``timeout_s``) first."""
    deadline = time.monotonic() + timeout_s
    while len(logged_steps(run_dir)) < n:
        if proc.poll() is not None or time.monotonic() > deadline:
            out = proc.stdout.read() if proc.stdout else ""
            raise AssertionError(f"the run ended or stalled before step {n} (exit {proc.poll()}):\n{out}")
        time.sleep(0.1)


def cmdline(pid: int) -> str:
    """The first 80 characters of ``pid``'s command line (``?``: gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")[:80]
    except OSError:
        return "?"


def alive(tree: dict[int, int]) -> dict[int, str]:
    """The processes of ``tree`` (pid -> start time, from :func:`descendants`) still running,
    with their command lines: a pid reused by another process does not count."""
    return {pid: cmdline(pid) for pid, started in tree.items() if process_start_time(pid) == started}


def wait_tree_gone(tree: dict[int, int], timeout_s: float = 15) -> dict[int, str]:
    """Wait up to ``timeout_s`` for the processes of ``tree`` to end; returns those left."""
    deadline = time.monotonic() + timeout_s
    while alive(tree) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive(tree)
