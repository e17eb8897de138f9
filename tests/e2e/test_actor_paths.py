"""The trainer end to end with the actor's alternative paths: the fused lm-head loss and the
materialised-logits loss give the same 3-step run, and so do a resident and an offloaded
reference policy (KL term on)."""

from __future__ import annotations

import pytest

from megatron_rl.loop.pipeline import make_trainer
from megatron_rl.observability import read_metrics
from tests.e2e.conftest import tiny_config

COMPARED = ("rollout/reward/mean", "loss/total", "actor/grad_norm", "loss/approx_kl")


def _run(tmp_path, name, *overrides):
    cfg = tiny_config(tmp_path / name, "trainer.num_steps=3", "trainer.eval_every_steps=0",
                      "trainer.save_every_steps=0", *overrides)  # fmt: skip
    trainer = make_trainer(cfg)
    try:
        trainer.run()
    finally:
        trainer.close()
    return {r["step"]: r for r in read_metrics(cfg.run_dir)}


def _same(a, b, keys, rel):
    assert sorted(a) == sorted(b) == [1, 2, 3]
    for step in a:
        for key in keys:
            assert b[step][key] == pytest.approx(a[step][key], rel=rel, abs=1e-7), (step, key)


def test_fused_lm_head_and_logits_paths_give_the_same_run(tmp_path, ray_session):
    fused = _run(tmp_path, "fused", "actor.loss_impl=fused_linear")
    logits = _run(tmp_path, "logits", "actor.loss_impl=logits")
    _same(fused, logits, COMPARED, rel=1e-5)


def test_offloaded_reference_gives_the_same_run(tmp_path, ray_session):
    kl = ("algorithm.kl_coef=0.05",)
    resident = _run(tmp_path, "resident", *kl, "actor.reference_offload=false")
    offloaded = _run(tmp_path, "offloaded", *kl, "actor.reference_offload=true")
    _same(resident, offloaded, (*COMPARED, "loss/ref_kl"), rel=0.0)
    assert resident[1]["loss/ref_kl"] == pytest.approx(0.0, abs=1e-6)  # the reference starts as the actor
    assert resident[3]["loss/ref_kl"] > 0.0  # and stays where it was while the actor moves
