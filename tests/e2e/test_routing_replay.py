"""Routing replay in a run (``rollout.routing_replay``) of the tiny MoE example: the
built-in engine returns its routers' choices, the actor replays them. The engines get FP8
weights (``rollout.weight_dtype: fp8``), so their routers choose differently from the
actor's float32 ones on some tokens: replay must make the actor's log-probs closer to the
engine's. Step 1 of both runs samples the same tokens from the same weights, so its
metrics compare the actor with and without replay on identical data."""

from tests.e2e.conftest import MOE_EXAMPLE

STEPS = ("trainer.num_steps=2", "trainer.eval_every_steps=0", "trainer.save_every_steps=0", "trainer.save_final=false",
         "rollout.weight_dtype=fp8")


def test_replaying_the_engines_routes_cuts_the_fp8_engines_logprob_mismatch(tiny_run):
    plain = tiny_run(*STEPS, example=MOE_EXAMPLE).rows
    replayed = tiny_run(*STEPS, "rollout.routing_replay=true", example=MOE_EXAMPLE).rows
    assert sorted(replayed) == [1, 2]
    first, before = replayed[1], plain[1]
    assert first["rollout/reward/mean"] == before["rollout/reward/mean"]  # the same samples
    assert first["rollout/logp_mismatch/num_tokens"] == before["rollout/logp_mismatch/num_tokens"]
    assert "moe/routing_agreement" not in before
    for row in replayed.values():
        assert 0.5 < row["moe/routing_agreement"] <= 1.0, row["moe/routing_agreement"]
    print({k: (before.get(k), first.get(k)) for k in sorted(first) if "mismatch" in k or "routing" in k})
    assert first["rollout/logp_mismatch/mean_abs"] < before["rollout/logp_mismatch/mean_abs"]
