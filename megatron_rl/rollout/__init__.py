"""Rollout: the engine interface, the HF and vLLM engines, the Ray pool, weight sync, mismatch.

    from megatron_rl.rollout import EngineSpec, PoolOptions, RolloutPool, SamplingParams

    pool = RolloutPool(EngineSpec(kind="hf", model_path=ckpt), num_engines=2)
    groups = pool.generate(prompt_ids, SamplingParams(n=4, temperature=0.7, seed=step))
    stats = pool.update_weights(actor.iter_hf_weights(), version=step + 1, bucket_mb=512)

Imports are lazy: ``import megatron_rl.rollout`` pulls in neither Ray, transformers nor
vLLM; each is imported by the submodule that needs it (see docs/rollout.md).
"""

from __future__ import annotations

import importlib
from typing import Any

from megatron_rl.rollout.base import (
    Completion,
    EngineAsleepError,
    RolloutEngine,
    SamplingParams,
    derive_seed,
    prompt_seeds_for,
)
from megatron_rl.rollout.mismatch import MismatchOutput, logprob_mismatch

_LAZY = {
    "HFEngine": "megatron_rl.rollout.hf_engine",
    "HFEngineArgs": "megatron_rl.rollout.hf_engine",
    "VLLMEngine": "megatron_rl.rollout.vllm_engine",
    "EngineSpec": "megatron_rl.rollout.pool",
    "PoolOptions": "megatron_rl.rollout.pool",
    "RolloutEngineError": "megatron_rl.rollout.pool",
    "RolloutPool": "megatron_rl.rollout.pool",
    "sync_weights": "megatron_rl.rollout.weight_sync",
}

__all__ = [
    "Completion",
    "EngineAsleepError",
    "MismatchOutput",
    "RolloutEngine",
    "SamplingParams",
    "derive_seed",
    "logprob_mismatch",
    "prompt_seeds_for",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'megatron_rl.rollout' has no attribute {name!r}")
