"""Weight sync from a TP=2 Megatron actor (two Ray actor ranks) into a rollout pool: the
engine ends up with exactly the actor's weights.

Checked three ways: (1) the pool engine's completions equal (log-probs to float32 rounding)
those of a fresh in-process engine loaded from the actor's own HF state dict; (2) the
engine's log-probs match the actor's recomputed log-probs (the mismatch metric) to
float32 rounding; (3) before the sync they did not (the engine started from other weights). Last, a rank
that hangs while it streams the buckets (SIGSTOP) fails the sync after
``actor.call_timeout_s`` naming the rank and the call, and the engine keeps its weights.
"""

import os
import signal
import time

import pytest
import ray

from megatron_rl.actor.group import ActorCallTimeoutError, ActorGroup
from megatron_rl.actor.spec import ActorSpec
from megatron_rl.algo.mismatch import logprob_mismatch
from megatron_rl.cluster.placement import GroupPlacement
from megatron_rl.config.parallel import ParallelConfig
from megatron_rl.config.rollout import RolloutConfig
from megatron_rl.config.trainer import TrainerConfig
from megatron_rl.loop.experience import build_experience
from megatron_rl.rollout.engines.hf import HFEngine
from megatron_rl.rollout.generation import SamplingParams
from megatron_rl.rollout.pool.pool import RolloutPool
from tests.helpers.rollout_models import ACTOR_HF_CONFIG as HF_CONFIG
from tests.helpers.rollout_models import save_actor_hf
from tests.ray_cluster import shared_ray


@pytest.fixture(scope="module")
def ray_session():
    shared_ray("distributed")


def test_sync_from_tp2_actor_gives_the_engine_the_actor_weights(tmp_path, ray_session):
    spec = ActorSpec(
        architecture=dict(HF_CONFIG),
        parallel=ParallelConfig(num_actor_ranks=2, tensor_model_parallel_size=2),
        trainer=TrainerConfig(seed=7),
    )
    actors = ActorGroup(spec)
    pool = RolloutPool(RolloutConfig(), str(save_actor_hf(tmp_path / "other", seed=123)),
                       placement=GroupPlacement.uniform(1, num_cpus=0.5))  # fmt: skip
    try:
        prompts = [[1, 2, 3, 4], [5, 6, 7], [8, 9]]
        params = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=11)

        def engine_vs_actor():
            comps = pool.generate(prompts, params)
            exp = build_experience(prompts, comps, pad_id=0)
            actor_lp = actors.compute_logprobs(exp.batch).logp  # at the spec's temperature, 1.0
            return comps, logprob_mismatch(exp.batch.engine_logp, actor_lp, exp.batch.loss_mask).metrics

        _, before = engine_vs_actor()
        assert before["rollout/logp_mismatch/max_abs"] > 1e-2  # different weights before the sync

        # The trainer's own path: rank 0 streams buckets, the pool loads them (bounded in flight).
        stats = pool.sync(actors.weight_buckets(1 << 14), version=1, metas=actors.weight_metadata())  # several buckets
        assert stats["weight_sync/num_buckets"] > 1

        synced, after = engine_vs_actor()
        assert after["rollout/logp_mismatch/max_abs"] < 1e-5
        assert all(c.weight_version == 1 for group in synced for c in group)

        fresh = HFEngine(save_actor_hf(tmp_path / "actor", state_dict=actors.hf_state_dict()))
        want = fresh.generate(prompts, params)
        for got_group, want_group in zip(synced, want):
            for got, ref_c in zip(got_group, want_group):
                assert got.token_ids == ref_c.token_ids
                # the pool's engine and this one run with different thread counts, so float
                # reductions may differ in the last bit
                assert got.logprobs == pytest.approx(ref_c.logprobs, abs=1e-6)

        # Rank 0 stopped (alive, silent): the stream's first bucket never comes.
        actors.call_timeout_s = 5.0
        metas = actors.weight_metadata()
        rank0 = ray.get(actors.workers[0].__ray_call__.remote(lambda worker: os.getpid()))
        os.kill(rank0, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(ActorCallTimeoutError, match=r"rank\(s\) \[0\] did not finish stream_weight_buckets\(\) "
                                                        r"within 5 s \(actor.call_timeout_s\)"):  # fmt: skip
            pool.sync(actors.weight_buckets(1 << 14), version=2, metas=metas)
        assert time.monotonic() - start < 60
        os.kill(rank0, signal.SIGCONT)
        with pytest.raises(ActorCallTimeoutError, match="not run"):  # the group is unusable from here on
            actors.weight_metadata()
        assert all(c.weight_version == 1 for group in pool.generate(prompts, params) for c in group)
    finally:
        pool.shutdown()
        actors.shutdown()
