"""The reaper (``megatron_rl/cli/reaper.py``): once a driver dies by SIGKILL, the
processes it started (children and grandchildren, even ones ignoring SIGTERM) die within
seconds, and the ``/dev/shm`` files they named after themselves are removed; a process
that merely reuses a recorded PID is never touched."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_rl.cli import reaper
from megatron_rl.cluster import processes
from megatron_rl.cluster.processes import process_start_time

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

# A "driver" that starts the reaper on itself, then a child that ignores SIGTERM and starts a
# grandchild; it prints the three pids and sleeps until it is killed.
_DRIVER = """
import os, signal, subprocess, sys, time
from megatron_rl.cli import reaper
reaper.start()
stubborn = "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); " \\
           "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); " \\
           "print(g.pid, flush=True); time.sleep(300)"
child = subprocess.Popen([sys.executable, "-c", stubborn], stdout=subprocess.PIPE, text=True)
grandchild = int(child.stdout.readline())
if os.path.isdir("/dev/shm"):  # a file the reaper removes (the shared-memory weight transport's kind)
    open(f"/dev/shm/megatron_rl_test_{child.pid}_{os.getpid()}", "w").close()
print(os.getpid(), child.pid, grandchild, flush=True)
time.sleep(300)
"""


def test_a_killed_drivers_processes_die_within_seconds():
    driver = subprocess.Popen([sys.executable, "-c", _DRIVER], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in driver.stdout.readline().split()]
        started = {p: process_start_time(p) for p in pids[1:]}
        assert all(started.values())
        time.sleep(2.5)  # the reaper looks once a second
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline and any(process_start_time(p) == s for p, s in started.items()):
        time.sleep(0.1)
    alive = [p for p, s in started.items() if process_start_time(p) == s]
    assert not alive, f"still alive 10 s after the driver was killed: {alive}"
    left = Path(f"/dev/shm/megatron_rl_test_{pids[1]}_{pids[0]}")
    while time.monotonic() < deadline and left.exists():
        time.sleep(0.1)
    assert not left.exists()


def test_leftover_shm_files_are_those_named_after_the_given_processes(tmp_path):
    for name in ("megatron_rl_weights_123_ab12", "megatron_rl_weights_1234_ab12", "megatron_rl_x_123_y",
                 "other_123_ab", "megatron_rl_weights_abc_123"):  # fmt: skip
        (tmp_path / name).touch()
    found = sorted(p.name for p in reaper.leftover_shm_files({123}, tmp_path))
    assert found == ["megatron_rl_weights_123_ab12", "megatron_rl_x_123_y"]
    assert reaper.leftover_shm_files({123}, tmp_path / "missing") == []


def test_descendants_follow_the_parent_links():
    table = {10: (1, 100), 11: (10, 110), 12: (11, 120), 13: (1, 130), 14: (13, 140)}
    assert processes.descendants({10}, table) == {11: 110, 12: 120}
    assert processes.descendants({99}, table) == {}


def test_a_reused_pid_is_not_signalled():
    me = os.getpid()
    assert processes.signal_all({me: process_start_time(me) + 1}, signal.SIGTERM) == 0
