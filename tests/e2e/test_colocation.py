"""Colocated engines and actor take turns (``rollout.placement: colocated``), on a real run.

The engine and the actor record what they do (``EngineWorker`` / ``ActorWorker``
transitions, wall-clock stamped); merged, each step must read: generate -> sleep ->
onload -> the update -> offload -> sync -> wake. The run's metrics must equal those of
the same run with ``placement: disaggregated`` (nothing is time-shared there): releasing
the gradient buffers and moving the train state changes no number.
"""

import pytest

from megatron_rl.config.rollout import RolloutConfig
from tests.e2e.conftest import KL_RUN

COMPARED = ("rollout/reward/mean", "loss/total", "actor/grad_norm", "loss/approx_kl", "rollout/logp_mismatch/max_abs")


def _steps(events):
    """The merged event list cut into steps at each ``engine:generate``."""
    steps, current = [], None
    for event in events:
        if event == "engine:generate":
            current = []
            steps.append(current)
        if current is not None:
            current.append(event)
    return steps


def test_colocated_run_takes_turns_and_equals_the_disaggregated_run(tiny_run):
    # The session's shared KL run (colocated by default), with a checkpoint at step 2.
    assert RolloutConfig().placement == "colocated"
    co = tiny_run(*KL_RUN)
    last, colocated, events = co.last, co.rows, co.events
    for key in ("timing_s/sleep", "timing_s/onload", "timing_s/offload", "timing_s/wake"):
        assert key in last, key
    steps = _steps(events)
    assert len(steps) == 3, events
    for step in steps:
        assert step[:3] == ["engine:generate", "engine:sleep", "actor:onload"], step
        body = step[3:]
        assert body[0] == "actor:train", step  # old/reference log-probs are part of the update
        train = body.index("actor:train")
        offload = body.index("actor:offload")
        assert train < offload < body.index("actor:sync") < body.index("engine:wake"), step
        assert body.index("engine:sync") > offload and body.index("engine:commit") < body.index("engine:wake"), step
        assert body[-1] == "engine:wake", step

    dis = tiny_run(*KL_RUN, "rollout.placement=disaggregated")
    disaggregated, events = dis.rows, dis.events
    assert not any(e in events for e in ("engine:sleep", "actor:offload")), events
    assert sorted(colocated) == sorted(disaggregated) == [1, 2, 3]
    for step in (1, 2, 3):
        for key in COMPARED:
            assert colocated[step][key] == pytest.approx(disaggregated[step][key], rel=0, abs=0), (step, key)
