"""A run's local Ray cluster whose node does not come up is started again
(``loop.builder.start_ray``).

Ray's raylet gives its dashboard agent a fixed 15 s to report its ports and aborts the
node when the agent is slower, as a machine with every core busy makes it (seen in CI:
``NodeManager::WaitForDashboardAgentPorts`` in raylet.out, then ``ray.init`` raising "The
current node timed out during startup" 30 s on). Here a ``sitecustomize`` on the driver's
``PYTHONPATH`` (inherited by Ray's daemons) makes the run's first dashboard agent sleep 25 s
before it starts, once: the first try fails that way, the second starts the cluster, and
only the second try's daemons are left.
"""

from __future__ import annotations

import os
import sys

from tests.helpers.jobs import run_job

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SLOW_FIRST_AGENT = """
import os, sys, time
if any(a.replace(os.sep, "/").endswith("dashboard/agent.py") for a in sys.argv):
    try:
        os.close(os.open(os.environ["MRL_TEST_SLOW_AGENT_MARKER"], os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        pass  # a later agent starts at its own speed
    else:
        time.sleep(25)
"""

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
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_FIRST_AGENT)
    marker = tmp_path / "slowed"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), REPO, env.get("PYTHONPATH")) if p)
    env["MRL_TEST_SLOW_AGENT_MARKER"] = str(marker)
    proc = run_job([sys.executable, "-c", DRIVER, str(tmp_path / "run")], env=env, cwd=REPO, timeout_s=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert marker.exists(), "the first dashboard agent was not slowed: the test tested nothing"
    assert "the local Ray cluster did not come up (try 1 of 3: The current node timed out during startup" in proc.stderr
    assert "try 2 of 3" not in proc.stderr
    assert "gcs 1 raylet 1" in proc.stdout, proc.stdout  # the failed try's daemons were stopped
