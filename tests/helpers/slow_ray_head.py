"""Make a Ray head node miss its start-up deadline once, as a busy machine does.

Ray's raylet gives its dashboard agent a fixed 15 s to report its ports and aborts the node
when the agent is slower (``NodeManager::WaitForDashboardAgentPorts`` in raylet.out; then
"The current node timed out during startup"). :func:`slow_first_head_agent` writes a
``sitecustomize`` that, on the ``PYTHONPATH`` of the process starting Ray (inherited by
Ray's daemons), makes the first dashboard agent of a head node (its command line carries
``--head``) sleep 40 s before it starts; later agents start at their own speed. The
sleep outlasts the failed try (Ray gives up on the node after 30 s), so the slowed agent
wakes while the next try starts: a retry that leaves it alive finds its ports taken when
they are fixed (seen in CI, where load made the agent that slow).
"""

from __future__ import annotations

from pathlib import Path

SITECUSTOMIZE = """
import os, sys, time
if "--head" in sys.argv and any(a.replace(os.sep, "/").endswith("dashboard/agent.py") for a in sys.argv):
    try:
        os.close(os.open(os.environ["MRL_TEST_SLOW_AGENT_MARKER"], os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        pass  # a later agent starts at its own speed
    else:
        time.sleep(40)
"""


def slow_first_head_agent(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """``(env, marker)``: the variables to add to the environment of whatever starts the
    Ray head (``PYTHONPATH`` is the site directory alone: prepend others as needed), and the
    file whose existence shows that an agent was slowed."""
    site = tmp_path / "slow_head_site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    marker = tmp_path / "slow_head_agent.fired"
    return {"PYTHONPATH": str(site), "MRL_TEST_SLOW_AGENT_MARKER": str(marker)}, marker
