"""The trainer end to end with the actor's alternative paths: the fused lm-head loss and the
materialised-logits loss give the same 3-step run, and so do a resident and an offloaded
reference policy (KL term on). The default-path runs are the session's shared ones
(``tiny_run``), which other modules compare against too."""

from __future__ import annotations

import pytest

from megatron_rl.config.trainer import ActorConfig
from tests.e2e.conftest import BASELINE, KL_RUN

COMPARED = ("rollout/reward/mean", "loss/total", "actor/grad_norm", "loss/approx_kl")


def _same(a, b, keys, rel):
    assert sorted(a) == sorted(b) == [1, 2, 3]
    for step in a:
        for key in keys:
            assert b[step][key] == pytest.approx(a[step][key], rel=rel, abs=1e-7), (step, key)


def test_fused_lm_head_and_logits_paths_give_the_same_run(tiny_run):
    assert ActorConfig().loss_impl == "fused_linear"  # the shared baseline's path
    fused = tiny_run(*BASELINE).rows
    logits = tiny_run(*BASELINE, "actor.loss_impl=logits").rows
    _same(fused, logits, COMPARED, rel=1e-5)


def test_offloaded_reference_gives_the_same_run(tiny_run):
    assert ActorConfig().reference_offload is False  # the shared KL run's reference stays resident
    resident = tiny_run(*KL_RUN).rows
    offloaded = tiny_run(*KL_RUN, "actor.reference_offload=true").rows
    _same(resident, offloaded, (*COMPARED, "loss/ref_kl"), rel=0.0)
    assert resident[1]["loss/ref_kl"] == pytest.approx(0.0, abs=1e-6)  # the reference starts as the actor
    assert resident[3]["loss/ref_kl"] > 0.0  # and stays where it was while the actor moves
