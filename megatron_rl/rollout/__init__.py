"""Rollout: the engine interface, the HF and vLLM engines, the Ray engine pool, and the
one-engine pool inside the driver's process (``rollout.engine_process: driver``).

    from megatron_rl.config.rollout import RolloutConfig
    from megatron_rl.rollout import RolloutPool, SamplingParams
    from megatron_rl.weight_sync.buckets import make_buckets

    pool = RolloutPool(RolloutConfig(num_engines=2), model_path=ckpt)
    groups = pool.generate(prompt_ids, SamplingParams(n=4, temperature=0.7, seed=step))
    stats = pool.sync(make_buckets(actor_weights, 512 << 20), version=step + 1)

Imports are lazy: ``import megatron_rl.rollout`` pulls in neither Ray, transformers nor
vLLM; each is imported by the submodule that needs it (see docs/rollout.md).
"""

from __future__ import annotations

import importlib
from typing import Any

from megatron_rl.config.seeding import derive_seed, prompt_seeds_for
from megatron_rl.rollout.engines.base import EngineAsleepError, RolloutEngine
from megatron_rl.rollout.generation import Completion, SamplingParams

_LAZY = {
    "HFEngine": "megatron_rl.rollout.engines.hf",
    "HFEngineArgs": "megatron_rl.rollout.engines.hf",
    "VLLMEngine": "megatron_rl.rollout.engines.vllm",
    "RolloutEngineError": "megatron_rl.rollout.pool.pool",
    "RolloutPool": "megatron_rl.rollout.pool.pool",
    "LocalRolloutPool": "megatron_rl.rollout.pool.local",
}

__all__ = [
    "Completion",
    "EngineAsleepError",
    "RolloutEngine",
    "SamplingParams",
    "derive_seed",
    "prompt_seeds_for",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'megatron_rl.rollout' has no attribute {name!r}")
