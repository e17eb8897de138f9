"""A run's local Ray cluster whose node does not come up is started again
(``loop.builder.start_ray``): the first try's head misses Ray's start-up deadline
(:mod:`tests.helpers.slow_ray_head`, seen in CI on a busy machine), the second starts the
cluster, and only the second try's daemons are left.
"""

from __future__ import annotations

import os
import sys

from tests.helpers.jobs import run_job
from tests.helpers.slow_ray_head import slow_first_head_agent

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DRIVER = """
import logging, sys
from pathlib import Path

import psutil
import ray

from megatron_rl.loop.builder import start_ray

logging.basicConfig(level=logging.WARNING)
start_ray(Path(sys.argv[1]))
names = [p.name() for p in psutil.Process().children(recursive=True)]
print("cpus", ray.cluster_resources().get("CPU"), "gcs", names.count("gcs_server"), "raylet", names.count("raylet"))
ray.shutdown()
"""


def test_a_local_cluster_that_does_not_come_up_is_started_again(tmp_path):
    slow_env, marker = slow_first_head_agent(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(slow_env, PYTHONPATH=os.pathsep.join(p for p in (slow_env["PYTHONPATH"], REPO, env.get("PYTHONPATH")) if p))
    proc = run_job([sys.executable, "-c", DRIVER, str(tmp_path / "run")], env=env, cwd=REPO, timeout_s=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert marker.exists(), "the first dashboard agent was not slowed: the test tested nothing"
    assert "the local Ray cluster did not come up (try 1 of 3: The current node timed out during startup" in proc.stderr
    assert "try 2 of 3" not in proc.stderr
    assert "gcs 1 raylet 1" in proc.stdout, proc.stdout  # the failed try's daemons were stopped
