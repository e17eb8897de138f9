"""One rollout engine inside its own Ray actor: the engine kinds and the actor's body.

``EngineWorker`` is what :class:`~megatron_rl.rollout.pool.RolloutPool` starts once per
engine (``ray.remote(EngineWorker)``): it builds the engine in the actor process and
forwards the pool's calls to it. ``build_engine`` resolves an engine kind: ``hf``,
``vllm``, or ``package.module:Class`` for a user :class:`RolloutEngine` subclass
(constructed as ``Class(model_path, name=..., **engine_args)``).
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import torch

from megatron_rl.rollout.base import Completion, RolloutEngine, SamplingParams
from megatron_rl.weight_buckets import WeightBucket

__all__ = ["BUILTIN_ENGINES", "EngineWorker", "build_engine"]

BUILTIN_ENGINES = {
    "hf": ("megatron_rl.rollout.hf_engine", "HFEngine"),
    "vllm": ("megatron_rl.rollout.vllm_engine", "VLLMEngine"),
}
"""Built-in engine kinds -> (module, class); imported only when an engine is built."""


def build_engine(kind: str, model_path: str, *, name: str, engine_args: dict[str, Any]) -> RolloutEngine:
    """Construct an engine of ``kind`` over ``model_path`` (imports the backend lazily)."""
    if kind in BUILTIN_ENGINES:
        module_name, cls_name = BUILTIN_ENGINES[kind]
    else:
        module_name, sep, cls_name = kind.partition(":")
        if not sep or not module_name or not cls_name:
            raise ValueError(f"engine kind {kind!r}: use 'hf', 'vllm' or 'package.module:Class'")
    cls = getattr(importlib.import_module(module_name), cls_name)
    if not (isinstance(cls, type) and issubclass(cls, RolloutEngine)):
        raise TypeError(f"engine kind {kind!r} is not a RolloutEngine subclass")
    return cls(model_path, name=name, **engine_args)


class EngineWorker:
    """The body of one engine's Ray actor: builds the engine and forwards calls to it."""

    def __init__(self, kind: str, model_path: str, engine_args: dict[str, Any], name: str, num_threads: int):
        # Before the engine imports anything heavy: one process per engine, so the torch
        # thread count is this actor's CPU share, not the whole machine.
        torch.set_num_threads(max(1, num_threads))
        self.engine = build_engine(kind, model_path, name=name, engine_args=engine_args)

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, prompt_seeds: list[int]
    ) -> list[list[Completion]]:
        return self.engine.generate(prompts, params, prompt_seeds=prompt_seeds)

    def load_bucket(self, bucket: WeightBucket, version: int) -> dict[str, int]:
        return self.engine.load_bucket(bucket, version)

    def sleep(self) -> None:
        self.engine.sleep()

    def wake(self) -> None:
        self.engine.wake()

    def health(self) -> dict[str, Any]:
        return {**self.engine.health(), "pid": os.getpid()}

    def node_id(self) -> str:
        """The Ray node this engine runs on (hex id)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def shutdown(self) -> None:
        self.engine.shutdown()
