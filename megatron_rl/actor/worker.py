"""One rank of the Megatron actor as a Ray actor process.

Each :class:`ActorWorker` runs one :class:`~megatron_rl.actor.actor.MegatronActor` (and,
when the loss has a KL term, the frozen reference policy: ``reference.py``, which always
holds the run's initial weights). The group (``group.py``) creates the workers, rank 0
reports its node's address and a free port, then every rank joins the same
``torch.distributed`` group (gloo on CPU, NCCL on GPU) and builds its model from the same
:class:`~megatron_rl.actor.spec.ActorSpec`. Every method here is collective: the group
calls it on every rank. The weight sync's sending side runs here too (the sender itself:
:mod:`megatron_rl.weight_sync.sender`).
"""


from __future__ import annotations

import gc
import logging
import os
import socket
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ray
import torch

from megatron_rl.actor.actor import LogProbs
from megatron_rl.actor.batch import ActorBatch
from megatron_rl.actor.spec import ActorSpec
from megatron_rl.storage.checkpoints import base_weights_of
from megatron_rl.weight_sync.buckets import WeightBucket, make_buckets
from megatron_rl.weight_sync.meta import TensorMeta, dtype_of

__all__ = ["ActorWorker", "is_hf_directory"]

logger = logging.getLogger(__name__)


def is_hf_directory(source: str) -> bool:
    """Whether ``source`` is a HF model directory (``config.json`` and safetensors), not a
    Megatron checkpoint."""
    path = Path(source)
    return (path / "config.json").exists() and any(path.glob("*.safetensors"))


class ActorWorker:
    """One rank of the actor group (constructed by Ray; see :class:`ActorGroup`)."""

    def __init__(self, *, rank: int, world_size: int, torch_threads: int):
        logger.info("this process is actor rank %d of %d", rank, world_size)
        self.rank = rank
        self.world_size = world_size
        torch.set_num_threads(torch_threads)  # parallel.cpu_threads (placement.cpu_threads)
        self.actor = None
        self.reference = None
        self.sender = None
        self.transitions: deque[tuple[float, str]] = deque(maxlen=256)
        """The last (wall time, event) pairs: what the rank did when (``transitions()``)."""

    def node_id(self) -> str:
        """The Ray node this rank runs on (hex id)."""
        return ray.get_runtime_context().get_node_id()

    def address(self) -> tuple[str, int]:
        """This node's IP and a free TCP port (asked of rank 0 for the rendezvous)."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, rendezvous: tuple[str, int] | None, spec: ActorSpec) -> None:
        """Join the Megatron world at rank 0's ``rendezvous`` (address, port) and build the
        actor (and reference) from ``spec``. Again (``ActorGroup.rebuild``, ``rendezvous``
        None): the world stays; the previous actor, reference and sender are dropped first."""
        from megatron_rl.actor.actor import MegatronActor
        from megatron_rl.actor.launch import init_process_group, initialize_parallel_from
        from megatron_rl.actor.reference import AdaptersOffReference, ReferencePolicy

        if self.actor is not None:
            self.close_weight_sender()
            self.actor = self.reference = None
            self.transitions.clear()  # the new actor's history starts here
            gc.collect()  # megatron's modules hold reference cycles: free the old weights now
        if rendezvous is not None:
            master_addr, master_port = rendezvous
            os.environ.update(
                MASTER_ADDR=master_addr,
                MASTER_PORT=str(master_port),
                RANK=str(self.rank),
                WORLD_SIZE=str(self.world_size),
                LOCAL_RANK="0",  # Ray gives each GPU worker its own CUDA_VISIBLE_DEVICES
            )
            init_process_group(rank=self.rank, world_size=self.world_size)
        groups = initialize_parallel_from(spec.parallel, seed=spec.trainer.seed)
        self.actor = MegatronActor(spec, groups=groups)
        if spec.with_reference and spec.lora is not None:
            self.reference = AdaptersOffReference(self.actor)  # the frozen base: no weights of its own
        elif spec.with_reference:
            self.reference = ReferencePolicy(spec, groups=groups)
            self.reference.copy_weights_from(self.actor)  # the random init, until initial weights load

    @property
    def _reference_weights(self):
        """The reference policy when it holds weights of its own (not a LoRA actor's)."""
        from megatron_rl.actor.reference import ReferencePolicy

        return self.reference if isinstance(self.reference, ReferencePolicy) else None

    def compute_logprobs(self, batch: ActorBatch, policy: str = "actor") -> LogProbs:
        self.transitions.append((time.time(), f"logprobs:{policy}"))
        model = self.reference if policy == "reference" else self.actor
        if model is None:
            raise RuntimeError(f"no {policy!r} model on this actor group (the loss has no KL term)")
        return model.compute_logprobs(batch)

    def update_policy(self, batch: ActorBatch, step: int, token_stats: bool) -> dict[str, float]:
        from megatron_rl.actor.update import update_policy

        self.transitions.append((time.time(), "train"))
        return update_policy(self.actor, self.reference, batch, step=step, token_stats=token_stats)

    def sft_step(self, batch: ActorBatch) -> dict[str, float]:
        self.transitions.append((time.time(), "sft"))
        return self.actor.sft_step(batch)

    def save_checkpoint(self, directory: str, trainer_state: dict[str, Any] | None) -> str:
        offloaded = self.actor.train_state_offloaded
        self.actor.onload_train_state()  # the optimizer state is saved from where it trains
        try:
            return str(self.actor.save_checkpoint(directory, trainer_state=trainer_state))
        finally:
            if offloaded:
                self.actor.offload_train_state()

    def offload_train_state(self) -> None:
        """Give the device to colocated engines: the actor's gradient buffers and optimizer
        state (``MegatronActor.offload_train_state``) and the reference's weights."""
        self.transitions.append((time.time(), "offload"))
        self.actor.offload_train_state()
        if self._reference_weights is not None:
            self._reference_weights.offload()

    def onload_train_state(self) -> None:
        """Take the device back for an update (the reference only if it is kept resident)."""
        self.transitions.append((time.time(), "onload"))
        self.actor.onload_train_state()
        if self._reference_weights is not None and not self._reference_weights.spec.actor.reference_offload:
            self._reference_weights.onload()

    def get_transitions(self) -> list[tuple[float, str]]:
        return list(self.transitions)

    def load_checkpoint(self, directory: str) -> dict[str, Any]:
        """The actor's state from a training checkpoint (resume); the reference keeps its weights."""
        return self.actor.load_checkpoint(directory)

    def load_initial_weights(self, source: str) -> None:
        """The run's initial weights into the actor AND the reference: a HF safetensors
        directory, or the weights of a Megatron checkpoint (an adapter-only LoRA checkpoint:
        the base weights it names first, then its adapters)."""
        base = base_weights_of(source)
        if base is not None:
            self.load_initial_weights(base["path"])
        if is_hf_directory(source):
            self.actor.load_hf_weights(source)
            if self._reference_weights is not None:
                self._reference_weights.load_hf_weights(source)
        else:  # the weights alone: counters, LR schedule, optimizer state and RNG are the run's own
            self.actor.load_checkpoint(source, weights_only=True)
            if self._reference_weights is not None:
                self._reference_weights.load_weights_checkpoint(source)

    def _weight_source(self, dtype: str, fp8: bool, *, every_rank: bool = False) -> Any:
        """The actor's HF-named tensors in ``dtype``, full on rank 0 only (or on
        ``every_rank``); with ``fp8`` the projection weights in block-wise FP8 plus their
        scales (``weight_sync.fp8``)."""
        source = self.actor.weight_source(dtype=dtype_of(dtype), every_rank=every_rank)
        if fp8:
            from megatron_rl.weight_sync.fp8 import Fp8Source

            return Fp8Source(source)
        return source

    def stream_weight_buckets(self, bucket_bytes: int, dtype: str, fp8: bool = False) -> Iterator[WeightBucket]:
        """Gather full HF-named tensors in ``dtype`` (collective on every rank) and, on rank
        0, yield them in buckets; run as a Ray streaming generator, each bucket lands in
        the object store as it is yielded. Other ranks take part in the gathers and yield
        nothing."""
        self.transitions.append((time.time(), "sync"))
        named = self._weight_source(dtype, fp8)
        if self.rank != 0:
            for _ in named:  # the ranks holding shards take part in the gathers
                pass
            return
        yield from make_buckets(named, bucket_bytes)

    def weight_metadata(self, dtype: str, fp8: bool = False) -> list[TensorMeta]:
        """Every HF-named tensor a sync sends, in ``dtype`` (no collectives)."""
        return self._weight_source(dtype, fp8).metadata()

    def open_weight_sender(
        self, backend: str, client: Any, init: dict[str, Any], dtype: str, bucket_bytes: int, fp8: bool = False
    ) -> None:
        """Join a transfer group with the engines behind ``client`` (``weight_sync.sender``)."""
        from megatron_rl.weight_sync.sender import open_sender

        self.close_weight_sender()
        # vLLM's IPC needs each GPU's own copy (every actor rank hands its engine worker one).
        source = self._weight_source(dtype, fp8, every_rank=backend == "ipc")
        self.sender = open_sender(
            source, rank=self.rank, backend=backend, client=client, init=init, bucket_bytes=bucket_bytes
        )

    def send_weights(self) -> Any:
        """One version through the open transfer group (collective on every rank); the
        sender's result (the ``shm`` backend: rank 0's file descriptor)."""
        if self.sender is None:
            raise RuntimeError("send_weights() before open_weight_sender()")
        self.transitions.append((time.time(), "sync"))
        return self.sender.send_weights()

    def close_weight_sender(self) -> None:
        sender, self.sender = getattr(self, "sender", None), None
        if sender is not None:
            sender.shutdown()

    def adapter_update(self) -> Any:
        """The LoRA adapters as PEFT tensors (``weight_sync.adapters.AdapterUpdate``) on rank 0,
        ``None`` elsewhere (collective on every rank)."""
        self.transitions.append((time.time(), "sync"))
        return self.actor.adapter_update()

    def hf_state_dict(self) -> dict[str, torch.Tensor] | None:
        """All HF-named tensors on rank 0 (for small models and tests); ``None`` elsewhere."""
        out = {name: t.clone() for name, t in self.actor.iter_hf_weights()}
        return out if self.rank == 0 else None
