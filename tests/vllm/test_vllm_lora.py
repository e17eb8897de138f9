"""A LoRA actor's adapters into a real vLLM engine (``rollout.lora_sync: adapter``), against
the same actor's merged weights in another vLLM engine.

The actor (TP=2, LoRA rank 8 on every projection of a tiny Qwen2) is updated so its
adapters are far from zero; the run's weight sync then sends the base weights once (the
engine starts from other weights) and the adapters at every version, which vLLM loads
through its LoRA path (PEFT files, ``load_inplace``). The reference engine receives
``W + (alpha/r) B A`` as ordinary weights (the actor's merged HF state dict, the merged
sync's payload). Both must sample the same tokens at the same seeds with log-probs within
5e-5 (float32; ``ENGINES_TOL`` says why not 1e-5), and match the actor's own recomputation (the trainer's mismatch metric)
within 1e-4. The second version must replace the first adapters in place, and an engine
restarted afterwards must come back with the base and the last adapters.
"""

import pytest
import torch

from megatron_rl.actor.batch import ActorBatch
from megatron_rl.actor.group import ActorGroup
from megatron_rl.actor.spec import ActorSpec
from megatron_rl.algo.mismatch import logprob_mismatch
from megatron_rl.cluster.placement import GroupPlacement
from megatron_rl.config.parallel import ParallelConfig
from megatron_rl.config.rollout import RolloutConfig
from megatron_rl.config.trainer import ActorConfig, LoRAConfig, TrainerConfig
from megatron_rl.loop.experience import build_experience
from megatron_rl.rollout import RolloutPool, SamplingParams
from megatron_rl.weight_sync.buckets import MIB, make_buckets
from megatron_rl.weight_sync.meta import TensorMeta
from megatron_rl.weight_sync.sync import WeightSync
from tests.helpers.rollout_models import VLLM_MODEL, VOCAB, save_qwen2, vllm_engine_args
from tests.ray_cluster import shared_ray

ray = pytest.importorskip("ray")

PROMPTS = [[1, 2, 3, 4], [5, 6, 7], list(range(20, 31))]
PARAMS = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=11)
RANK = 8
ENGINES_TOL = 5e-5
"""Adapter engine vs merged engine, float32. Each is 1.1e-5 to 2.0e-5 from the actor's own
log-probs on this model and they are 1.5e-5 to 2.3e-5 apart whatever the adapters' size
(measured with B ~1e-4 and ~1e-2): vLLM's float32 arithmetic of ``x W^T + s (x A^T) B^T``
against ``x (W + s B A)^T``, not the adapters."""


def _batch(step: int) -> ActorBatch:
    g = torch.Generator().manual_seed(step)
    n, length, prompt = 8, 14, 4
    ids = torch.randint(0, VOCAB, (n, length), generator=g)
    attn = torch.ones(n, length, dtype=torch.long)
    loss_mask = attn.clone()
    loss_mask[:, :prompt] = 0
    advantages = torch.randn(n, 1, generator=g).expand(n, length).clone()
    return ActorBatch(input_ids=ids, attention_mask=attn, loss_mask=loss_mask, advantages=advantages,
                      engine_logp=-torch.rand(n, length, generator=g) * 6)  # fmt: skip


def _generate(pool):
    got = pool.generate(PROMPTS, PARAMS)
    return got, [[c.token_ids for c in group] for group in got]


def _max_logp_gap(a, b) -> float:
    return max(abs(x - y) for ga, gb in zip(a, b) for ca, cb in zip(ga, gb) for x, y in zip(ca.logprobs, cb.logprobs))


def test_adapter_sync_equals_merged_weights(tmp_path):
    base_dir = save_qwen2(tmp_path / "base", seed=5, **VLLM_MODEL)
    other_dir = save_qwen2(tmp_path / "other", seed=9, **VLLM_MODEL)
    shared_ray("vllm")
    rollout = RolloutConfig(engine="vllm", engine_args=vllm_engine_args(), lora_sync="adapter",
                            weight_transport="collective", weight_sync_bucket_mb=1)  # fmt: skip
    spec = ActorSpec(
        architecture=str(base_dir),
        parallel=ParallelConfig(num_actor_ranks=2, tensor_model_parallel_size=2),
        trainer=TrainerConfig(seed=7, lr=5e-3, weight_decay=0.0),
        actor=ActorConfig(lora=LoRAConfig(rank=RANK, alpha=16.0)),
        rollout=rollout,
    )  # fmt: skip
    actors = ActorGroup(spec, GroupPlacement.uniform(2, num_cpus=0.25))
    lora_pool = RolloutPool(rollout, str(other_dir), placement=GroupPlacement.uniform(1, num_cpus=0.25),
                            weight_backend="gloo", lora_rank=RANK)  # fmt: skip
    merged_pool = RolloutPool(RolloutConfig(engine="vllm", engine_args=vllm_engine_args()), str(other_dir),
                              placement=GroupPlacement.uniform(1, num_cpus=0.25))  # fmt: skip
    sync = WeightSync(actors, lora_pool, rollout, transport="collective", backend="gloo")
    try:
        actors.load_initial_weights(str(base_dir))
        stats = sync.run(0)  # B = 0: the engine generates as the base model does
        assert stats["weight_sync/base_sent"] == 1.0  # it started from other weights
        base_out, base_ids = _generate(lora_pool)
        for version in (1, 2):
            actors.update_policy(_batch(version), version)
            stats = sync.run(version)
            assert stats["weight_sync/base_sent"] == 0.0, stats  # the adapters alone
            assert stats["weight_sync/adapter_bytes"] > 0 and stats["weight_sync/retries"] == 0
            assert lora_pool.weight_version == version
            merged = actors.hf_state_dict()
            merged_pool.sync(make_buckets(merged.items(), MIB), version=version,
                             metas=[TensorMeta.of(n, t) for n, t in merged.items()])  # fmt: skip
            (got, ids), (want, want_ids) = _generate(lora_pool), _generate(merged_pool)
            assert ids == want_ids, version
            gap = _max_logp_gap(got, want)
            print(f"version {version}: adapter vs merged engine max |dlogp| {gap:.2e}")  # pytest -s: docs/lora.md
            assert gap <= ENGINES_TOL, version
            assert all(c.weight_version == version for g in got for c in g)
            exp = build_experience(PROMPTS, got, pad_id=0)
            metrics = logprob_mismatch(exp.batch.engine_logp, actors.compute_logprobs(exp.batch).logp,
                                       exp.batch.loss_mask).metrics  # fmt: skip
            print(f"version {version}: adapter engine vs actor max |dlogp| {metrics['rollout/logp_mismatch/max_abs']:.2e}")
            assert metrics["rollout/logp_mismatch/max_abs"] <= 1e-4, (version, metrics)
        # the adapters moved the policy far beyond those tolerances (the test could fail)
        assert ids != base_ids or _max_logp_gap(got, base_out) > 1e-3
        # a restarted engine comes back with the base (from the actor) and the last adapters
        lora_pool.restart([0])
        assert lora_pool.weight_version == 2
        again, again_ids = _generate(lora_pool)
        assert again_ids == want_ids and _max_logp_gap(again, want) <= ENGINES_TOL
    finally:
        sync.close()
        lora_pool.shutdown()
        merged_pool.shutdown()
        actors.shutdown()
