"""The trainer end to end with the actor's alternative paths: the fused lm-head loss and the
materialised-logits loss give the same 3-step run, and so do a resident and an offloaded
reference policy (KL term on); a LoRA run (``actor.lora``) starts as the full-parameter
one and its engines follow the merged policy. The default-path runs are the session's
shared ones (``tiny_run``), which other modules compare against too."""

from __future__ import annotations

import pytest

from megatron_rl.config.trainer import ActorConfig
from tests.e2e.conftest import BASELINE, KL_RUN, assert_adapters_only

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


def test_a_lora_run_starts_at_the_base_model_and_its_engines_follow_the_merged_policy(tiny_run):
    """``actor.lora`` on the KL run: B = 0 makes step 1 the full-parameter run's step 1 (same
    rollouts, same loss); the reference is the actor with its adapters off (KL 0 at the
    start, growing as the adapters train); the engines generate with the merged weights
    (the actor's recomputed log-probs match theirs while the policy moves away from the base)."""
    full = tiny_run(*KL_RUN).rows
    lora = tiny_run(*KL_RUN, "actor.lora.rank=8").rows
    assert sorted(lora) == [1, 2, 3]
    for key in ("rollout/reward/mean", "loss/total", "loss/approx_kl"):
        assert lora[1][key] == pytest.approx(full[1][key], rel=1e-6, abs=1e-7), key
    assert lora[1]["loss/ref_kl"] == pytest.approx(0.0, abs=1e-6)
    assert lora[3]["loss/ref_kl"] > 1e-5
    assert lora[3]["actor/grad_norm"] != pytest.approx(full[3]["actor/grad_norm"], rel=1e-3)  # other parameters train
    assert max(r["rollout/logp_mismatch/max_abs"] for r in lora.values()) <= 1e-5


def test_a_lora_run_over_base_weights_from_a_checkpoint_saves_the_adapters_only(tiny_run):
    """``actor.lora`` over ``model.checkpoint`` (the full-parameter KL run's step-2 checkpoint):
    its checkpoint holds the adapters and their optimizer state only and names that base;
    a new run from it (``model.checkpoint`` = the adapter-only checkpoint) loads the base and
    then the adapters: its reference policy (adapters off) is the base, so its KL to it is
    non-zero from step 1, and its engines hold the merged policy."""
    base = tiny_run(*KL_RUN).run_dir / "checkpoints" / "step_000002"
    over = ("model.init=pretrained", "actor.lora.rank=8", "algorithm.kl_coef=0.01", "trainer.eval_every_steps=0")
    first = tiny_run("trainer.num_steps=2", "trainer.save_every_steps=2", f"model.checkpoint={base}", *over)
    saved = first.run_dir / "checkpoints" / "step_000002"
    assert_adapters_only(saved, base)
    assert first.rows[1]["loss/ref_kl"] == pytest.approx(0.0, abs=1e-6)  # B = 0: the actor is the base
    second = tiny_run("trainer.num_steps=1", "trainer.save_every_steps=0", f"model.checkpoint={saved}", *over).rows
    assert second[1]["loss/ref_kl"] > 1e-6  # the trained adapters are on, the reference is the base
    assert second[1]["rollout/logp_mismatch/max_abs"] <= 1e-5
