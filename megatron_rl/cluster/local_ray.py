"""A Ray cluster of this process's own (``ray.init`` that starts one), started again when
its node does not come up.

Ray's raylet gives its dashboard agent (a Python process) a fixed 15 s to report its ports
and aborts the node when the agent is slower, which a machine with every core busy can make
it; ``ray.init`` then raises "The current node timed out during startup" after its own
fixed 30 s (neither limit is a setting in Ray 2.60). The next try usually wins. A Slurm
job's nodes get the same treatment from ``slurm/ray_node.sh``.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import ray

from megatron_rl.cluster.processes import descendants, process_start_time, signal_all

__all__ = ["LEAN_RAY_SYSTEM_CONFIG", "RAY_START_TRIES", "start_local_ray"]

logger = logging.getLogger(__name__)

LEAN_RAY_SYSTEM_CONFIG = {"enable_worker_prestart": False, "prestart_worker_first_driver": False}
"""Ray system settings of a cluster a run starts (its own, or a Slurm job's head:
``slurm/ray_node.sh`` reads them here). Ray prestarts a Python worker per CPU for the first
driver, kept as long as the node lives, but every worker of a run is an actor with the run's
``runtime_env``, which a prestarted worker lacks: they only sat idle (~45 MB and their
start-up CPU each; on a 128-CPU node, over 100 processes)."""

RAY_START_TRIES = 3
"""Tries to start a local cluster (see the module docstring)."""

_RAY_START_RACE = "timed out during startup"
"""What Ray's (plain ``Exception``) error says when the node did not come up."""


def start_local_ray(init: Callable[[], Any]) -> None:
    """``init()`` (a ``ray.init`` that starts a cluster of this process's own), tried again
    while the node does not come up (:data:`RAY_START_TRIES`), the failed try's processes
    stopped first."""
    for attempt in range(1, RAY_START_TRIES + 1):
        before = descendants({os.getpid()})
        try:
            init()
            return
        except Exception as e:
            if _RAY_START_RACE not in str(e) or attempt == RAY_START_TRIES:
                raise
            logger.warning("the local Ray cluster did not come up (try %d of %d: %s); stopping what it started and "
                           "starting it again", attempt, RAY_START_TRIES, e)  # fmt: skip
            # What the failed try started (GCS, agents, log monitor): this process's new descendants.
            started = {pid: t for pid, t in descendants({os.getpid()}).items() if pid not in before}
            signal_all(started, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and any(process_start_time(p) == t for p, t in started.items()):
                time.sleep(0.05)
            ray.shutdown()  # whatever state the failed ray.init left in this process
