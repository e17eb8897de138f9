"""One rollout engine inside its own Ray actor: the engine kinds and the actor's body.

``EngineWorker`` is what :class:`~megatron_rl.rollout.pool.pool.RolloutPool` starts once per
engine (``ray.remote(EngineWorker)``): it builds the engine in the actor process and
forwards the pool's calls to it. ``build_engine`` resolves an engine kind: ``hf``,
``vllm``, or ``package.module:Class`` for a user :class:`RolloutEngine` subclass
(constructed as ``Class(model_path, name=..., **engine_args)``).
"""

from __future__ import annotations

import gc
import importlib
import logging
import os
import time
from collections import deque
from typing import Any

import torch

from megatron_rl.rollout.engines.base import RolloutEngine
from megatron_rl.rollout.generation import Completion, SamplingParams
from megatron_rl.weight_sync.adapters import AdapterUpdate
from megatron_rl.weight_sync.buckets import WeightBucket
from megatron_rl.weight_sync.meta import TensorMeta
from megatron_rl.weight_sync.transports.shm import SharedBucket

__all__ = ["BUILTIN_ENGINES", "EngineWorker", "build_engine", "engine_class"]

BUILTIN_ENGINES = {
    "hf": ("megatron_rl.rollout.engines.hf", "HFEngine"),
    "vllm": ("megatron_rl.rollout.engines.vllm", "VLLMEngine"),
}
"""Built-in engine kinds -> (module, class); imported only when an engine is built."""


def engine_class(kind: str) -> type[RolloutEngine]:
    """The :class:`RolloutEngine` subclass of an engine kind (imports its module)."""
    if kind in BUILTIN_ENGINES:
        module_name, cls_name = BUILTIN_ENGINES[kind]
    else:
        module_name, sep, cls_name = kind.partition(":")
        if not sep or not module_name or not cls_name:
            raise ValueError(f"engine kind {kind!r}: use 'hf', 'vllm' or 'package.module:Class'")
    cls = getattr(importlib.import_module(module_name), cls_name)
    if not (isinstance(cls, type) and issubclass(cls, RolloutEngine)):
        raise TypeError(f"engine kind {kind!r} is not a RolloutEngine subclass")
    return cls


def build_engine(
    kind: str, model_path: str, *, name: str, engine_args: dict[str, Any], weight_backend: str = "object_store",
    tensor_parallel_size: int = 1, routed_experts: bool = False, lora_rank: int | None = None,
    own_process: bool = False,
) -> RolloutEngine:  # fmt: skip
    """Construct an engine of ``kind`` over ``model_path`` that receives weights through
    ``weight_backend``, spans ``tensor_parallel_size`` devices (``rollout.tensor_parallel_size``)
    and, with ``routed_experts``, returns the experts it routed each token to
    (``rollout.routing_replay``) and, with ``lora_rank``, loads LoRA adapters of that rank
    (``rollout.lora_sync: adapter``). ``own_process``: the engine has this process to itself
    (:class:`EngineWorker`), told to engines that use it (``RolloutEngine.own_process``)."""
    cls = engine_class(kind)
    if weight_backend not in cls.weight_backends:
        raise ValueError(
            f"engine kind {kind!r} cannot receive weights through {weight_backend!r}: {cls.weight_backends}"
        )
    extra = dict(cls.weight_transfer_args(weight_backend))
    if tensor_parallel_size > 1:
        if not cls.tensor_parallel:
            raise ValueError(f"engine kind {kind!r} has no tensor parallelism (rollout.tensor_parallel_size "
                             f"{tensor_parallel_size})")  # fmt: skip
        extra["tensor_parallel_size"] = tensor_parallel_size
    if routed_experts:
        if not cls.routed_experts:
            raise ValueError(f"engine kind {kind!r} cannot return routed experts (rollout.routing_replay)")
        extra["return_routed_experts"] = True
    if lora_rank is not None:
        if not cls.lora_adapters:
            raise ValueError(f"engine kind {kind!r} loads no LoRA adapters (rollout.lora_sync: adapter)")
        extra["lora_rank"] = lora_rank
    if own_process and cls.own_process:
        extra["own_process"] = True
    return cls(model_path, name=name, **engine_args, **extra)


logger = logging.getLogger(__name__)

class EngineWorker:
    """The body of one engine's Ray actor: builds the engine and forwards calls to it."""

    def __init__(
        self, kind: str, model_path: str, engine_args: dict[str, Any], name: str, num_threads: int,
        weight_backend: str = "object_store", visible_devices: tuple[str, ...] | None = None,
        weight_format: str = "auto", tensor_parallel_size: int = 1, routed_experts: bool = False,
        lora_rank: int | None = None,
    ):  # fmt: skip
        if visible_devices is not None:
            # An engine over several GPUs holds the Ray bundle of its first GPU only (the
            # others are reserved in the placement group); before CUDA is initialised,
            # let the process see all of them (``megatron_rl.cluster.placement``).
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(visible_devices)
        logger.info("this process is rollout engine %s", name)
        # Before the engine imports anything heavy: one process per engine, so the torch
        # thread count is this actor's CPU share, not the whole machine.
        torch.set_num_threads(max(1, num_threads))
        self._build_args = {"kind": kind, "model_path": model_path, "name": name, "engine_args": engine_args,
                            "weight_backend": weight_backend, "tensor_parallel_size": tensor_parallel_size,
                            "routed_experts": routed_experts, "lora_rank": lora_rank,
                            "own_process": True}  # fmt: skip
        self._weight_format = weight_format
        self._build()

    def _build(self) -> None:
        self.engine = build_engine(**self._build_args)
        self.engine.set_weight_format(self._weight_format)
        self.transitions: deque[tuple[float, str]] = deque(maxlen=256)
        """The last (wall time, event) pairs: generate, sleep, wake, sync (begin), commit, adapter."""

    def reset(self) -> dict[str, Any]:
        """Build the engine again from this actor's constructor arguments, in this process:
        what Ray's restart would give in a new one, without its seconds of imports (a kept
        engine handed to the next run, ``loop.warm``). Its health report."""
        self.engine.shutdown()
        self.engine = None
        gc.collect()  # the old model's memory before the new one's
        self._build()
        return self.health()

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, prompt_seeds: list[int]
    ) -> list[list[Completion]]:
        self.transitions.append((time.time(), "generate"))
        return self.engine.generate(prompts, params, prompt_seeds=prompt_seeds)

    # Weight updates (see RolloutEngine): begin -> load_bucket* | receive_weights -> commit.
    def begin_weight_update(self, version: int, metas: list[TensorMeta]) -> None:
        self.transitions.append((time.time(), "sync"))
        self.engine.begin_weight_update(version, metas)

    def load_bucket(self, bucket: WeightBucket | SharedBucket) -> dict[str, int]:
        """One bucket into the open update; a :class:`SharedBucket` (``rollout.weight_transport:
        shared_memory``) is read from this process's mapping of the actor's shared file."""
        if isinstance(bucket, SharedBucket):
            bucket = WeightBucket(entries=list(bucket.entries), arrays=bucket.arrays())
        return self.engine.load_bucket(bucket)

    def init_weight_transfer(self, init_info: dict[str, Any]) -> None:
        self.engine.init_weight_transfer(init_info)

    def receive_weights(self, update_info: dict[str, Any]) -> None:
        self.engine.receive_weights(update_info)

    def commit_weight_update(self) -> int:
        self.transitions.append((time.time(), "commit"))
        return self.engine.commit_weight_update()

    def abort_weight_update(self) -> None:
        self.engine.abort_weight_update()

    def load_adapter(self, version: int, update: AdapterUpdate) -> int:
        self.transitions.append((time.time(), "adapter"))
        return self.engine.load_adapter(version, update)

    def sleep(self) -> None:
        self.transitions.append((time.time(), "sleep"))
        self.engine.sleep()

    def wake(self) -> None:
        self.transitions.append((time.time(), "wake"))
        self.engine.wake()

    def get_transitions(self) -> list[tuple[float, str]]:
        return list(self.transitions)

    def health(self) -> dict[str, Any]:
        return {**self.engine.health(), "pid": os.getpid()}

    def weight_checksums(self) -> dict[str, str]:
        """The engine's per-parameter digests, where it has them (vLLM); equal for two
        engines holding the same weights."""
        checksums = getattr(self.engine, "weight_checksums", None)
        if checksums is None:
            raise NotImplementedError(f"{type(self.engine).__name__} computes no weight checksums")
        return checksums()

    def node_id(self) -> str:
        """The Ray node this engine runs on (hex id)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def gpu_ids(self) -> dict[str, Any]:
        """The GPUs Ray gave this engine and what its process sees (``CUDA_VISIBLE_DEVICES``)."""
        import ray

        return {"ray_gpu_ids": [str(g) for g in ray.get_gpu_ids()], "cuda_visible_devices": os.environ.get(
            "CUDA_VISIBLE_DEVICES")}  # fmt: skip

    def shutdown(self) -> None:
        self.engine.shutdown()
