"""The Megatron actor's ranks as Ray actors, driven as one group by the trainer.

Every rank is a Ray actor process running one :class:`~megatron_rl.actor.actor.MegatronActor`.
The group is started in two phases: the workers are created (where
:mod:`megatron_rl.placement` says), rank 0 reports its node's address and a free port,
then every rank joins the same ``torch.distributed`` group (gloo on CPU, NCCL on GPU)
and builds its model from the same :class:`~megatron_rl.actor.spec.ActorSpec`, received
once. Each call of the group runs the same method on every rank (the actor's methods are
collective) and returns rank 0's result.

When the loss has a KL term each rank also holds the frozen reference policy
(``reference.py``: weights only, optionally offloaded to host memory), which always
holds the run's initial weights: a copy of the actor's at construction, then whatever
:meth:`ActorWorker.load_initial_weights` loads into both.

The group also keeps the run's non-finite rule: a step whose updates were skipped for a
non-finite loss or gradient norm is counted, and ``trainer.max_consecutive_nonfinite_steps``
of them in a row raise :class:`NonFiniteStepsError` (the counter is saved with the
driver's state in every checkpoint).
"""

from __future__ import annotations

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
from megatron_rl.placement import GroupPlacement
from megatron_rl.weight_buckets import WeightBucket, make_buckets
from megatron_rl.weight_transfer.meta import TensorMeta, dtype_of

__all__ = ["ActorGroup", "ActorWorker", "NonFiniteStepsError", "is_hf_directory"]

logger = logging.getLogger(__name__)


def is_hf_directory(source: str) -> bool:
    """Whether ``source`` is a HF model directory (``config.json`` and safetensors), not a
    Megatron checkpoint."""
    path = Path(source)
    return (path / "config.json").exists() and any(path.glob("*.safetensors"))


class NonFiniteStepsError(RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradient norm."""


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

    def setup(self, rendezvous: tuple[str, int], spec: ActorSpec) -> None:
        """Join the Megatron world at rank 0's ``rendezvous`` (address, port) and build the
        actor (and reference) from ``spec``."""
        from megatron_rl.actor.actor import MegatronActor
        from megatron_rl.actor.launch import init_process_group, initialize_parallel
        from megatron_rl.actor.reference import ReferencePolicy

        master_addr, master_port = rendezvous
        os.environ.update(
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK="0",  # Ray gives each GPU worker its own CUDA_VISIBLE_DEVICES
        )
        init_process_group(rank=self.rank, world_size=self.world_size)
        groups = initialize_parallel(
            tensor_model_parallel_size=spec.parallel.tensor_model_parallel_size,
            pipeline_model_parallel_size=spec.parallel.pipeline_model_parallel_size,
            seed=spec.trainer.seed,
        )
        self.actor = MegatronActor(spec, groups=groups)
        if spec.with_reference:
            self.reference = ReferencePolicy(spec, groups=groups)
            self.reference.copy_weights_from(self.actor)  # the random init, until initial weights load

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
        if self.reference is not None:
            self.reference.offload()

    def onload_train_state(self) -> None:
        """Take the device back for an update (the reference only if it is kept resident)."""
        self.transitions.append((time.time(), "onload"))
        self.actor.onload_train_state()
        if self.reference is not None and not self.reference.spec.actor.reference_offload:
            self.reference.onload()

    def get_transitions(self) -> list[tuple[float, str]]:
        return list(self.transitions)

    def load_checkpoint(self, directory: str) -> dict[str, Any]:
        """The actor's state from a training checkpoint (resume); the reference keeps its weights."""
        return self.actor.load_checkpoint(directory)

    def load_initial_weights(self, source: str) -> None:
        """The run's initial weights into the actor AND the reference: a HF safetensors
        directory, or the weights of a Megatron checkpoint."""
        if is_hf_directory(source):
            self.actor.load_hf_weights(source)
            if self.reference is not None:
                self.reference.load_hf_weights(source)
        else:
            self.actor.load_checkpoint(source)
            if self.reference is not None:
                self.reference.load_weights_checkpoint(source)

    def _weight_source(self, dtype: str, bucket_bytes: int, fp8: bool) -> Any:
        """The actor's HF-named tensors in ``dtype``; with ``fp8`` the projection weights in
        block-wise FP8 plus their scales (``weight_transfer.fp8``)."""
        source = self.actor.weight_source(dtype=dtype_of(dtype), bucket_bytes=bucket_bytes)
        if fp8:
            from megatron_rl.weight_transfer.fp8 import Fp8Source

            return Fp8Source(source)
        return source

    def stream_weight_buckets(self, bucket_bytes: int, dtype: str, fp8: bool = False) -> Iterator[WeightBucket]:
        """Gather full HF-named tensors in ``dtype`` (collective on every rank) and, on rank
        0, yield them in buckets; run as a Ray streaming generator, each bucket lands in
        the object store as it is yielded. Other ranks take part in the gathers and yield
        nothing."""
        self.transitions.append((time.time(), "sync"))
        named = self._weight_source(dtype, bucket_bytes, fp8)
        if self.rank != 0:
            for _ in named:  # every rank takes part in the gathers
                pass
            return
        yield from make_buckets(named, bucket_bytes)

    def weight_metadata(self, dtype: str, fp8: bool = False) -> list[TensorMeta]:
        """Every HF-named tensor a sync sends, in ``dtype`` (no collectives)."""
        return self._weight_source(dtype, 1, fp8).metadata()

    def open_weight_sender(
        self, backend: str, client: Any, init: dict[str, Any], dtype: str, bucket_bytes: int, fp8: bool = False
    ) -> None:
        """Join a transfer group with the engines behind ``client`` (``actor.transfer``)."""
        from megatron_rl.actor.transfer import open_sender

        self.close_weight_sender()
        source = self._weight_source(dtype, bucket_bytes, fp8)
        self.sender = open_sender(source, rank=self.rank, backend=backend, client=client, init=init)

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

    def write_hf_weights(self, directory: str, dtype: str) -> None:
        """The model's HF safetensors into ``directory`` (rank 0 writes; see ``actor.transfer``)."""
        from megatron_rl.actor.transfer import write_hf_weights

        write_hf_weights(self.actor.weight_source(dtype=dtype_of(dtype)), Path(directory), rank=self.rank)

    def hf_state_dict(self) -> dict[str, torch.Tensor] | None:
        """All HF-named tensors on rank 0 (for small models and tests); ``None`` elsewhere."""
        out = {name: t.clone() for name, t in self.actor.iter_hf_weights()}
        return out if self.rank == 0 else None


class ActorGroup:
    """The actor's ranks (``spec.parallel.num_actor_ranks`` :class:`ActorWorker` Ray actors)
    forming one Megatron world.

    Args:
        spec: what every rank builds (sent once, at construction).
        placement: where each rank runs (:mod:`megatron_rl.placement`); default: Ray's own
            scheduling, no reserved resources, one torch thread per rank.
        wait: return once every rank has built its model (a failure raises here); false
            returns at once, the ranks start and build in the background, and the first
            call that uses them (or :meth:`wait_ready`) waits and raises a failure. So
            the driver can start the engines meanwhile.
    """

    def __init__(self, spec: ActorSpec, placement: GroupPlacement | None = None, *, wait: bool = True):
        num_ranks = spec.parallel.num_actor_ranks
        placement = placement or GroupPlacement.uniform(num_ranks)
        if len(placement) != num_ranks:
            raise ValueError(f"placement has {len(placement)} members for {num_ranks} actor ranks")
        self.spec = spec
        self.consecutive_nonfinite = 0
        """RL steps in a row whose updates were skipped (see :meth:`update_policy`)."""
        self.workers = [
            ray.remote(ActorWorker)
            .options(max_restarts=0, **options)
            .remote(rank=r, world_size=num_ranks, torch_threads=placement.torch_threads)
            for r, options in enumerate(placement.ray_options)
        ]
        # Rank 0's address goes to every rank's setup as a reference Ray resolves when
        # rank 0 has started: nothing here waits for a process.
        rendezvous = self.workers[0].address.remote()
        self._setup: list[Any] | None = [w.setup.remote(rendezvous, spec) for w in self.workers]
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Wait until every rank has built its model; raises the first rank's failure."""
        pending, self._setup = self._setup, None
        if pending:
            ray.get(pending)

    def _all(self, method: str, *args, **kwargs) -> Any:
        """Run ``method`` on every rank (collective); rank 0's result."""
        return ray.get(self._submit(method, *args, **kwargs))[0]

    def _submit(self, method: str, *args, **kwargs) -> list[Any]:
        """Queue ``method`` on every rank (each runs its calls in submission order); the
        pending results, rank 0's first."""
        self.wait_ready()
        return [getattr(w, method).remote(*args, **kwargs) for w in self.workers]

    def _shared(self, value: Any) -> Any:
        """An argument for every rank: one object-store copy for several ranks; for one rank
        the value itself (Ray inlines a small argument into the call: no put, ~1.5 ms less)."""
        return ray.put(value) if len(self.workers) > 1 else value

    def compute_logprobs(self, batch: ActorBatch, *, policy: str = "actor") -> LogProbs:
        """Per-token log-probs and entropies of ``batch`` (``policy``: actor or reference)."""
        return self._all("compute_logprobs", self._shared(batch), policy)

    def update_policy(self, batch: ActorBatch, step: int, *, token_stats: bool = False) -> dict[str, float]:
        """RL step ``step``'s whole update on ``batch`` (see ``actor/update.py``); its metrics.

        Raises :class:`NonFiniteStepsError` once ``trainer.max_consecutive_nonfinite_steps``
        steps in a row had a skipped (non-finite) update."""
        return self.finish_update(self.submit_update(batch, step, token_stats=token_stats))

    def submit_update(self, batch: ActorBatch, step: int, *, token_stats: bool = False) -> list[Any]:
        """Start :meth:`update_policy` on every rank and return at once (its pending results:
        pass them to :meth:`finish_update`). Each rank runs its calls in submission order, so
        anything submitted later (a weight sync, a checkpoint) sees the updated weights."""
        return self._submit("update_policy", self._shared(batch), step, token_stats)

    def finish_update(self, pending: list[Any]) -> dict[str, float]:
        """Wait for a :meth:`submit_update`; its metrics (see :meth:`update_policy`)."""
        metrics = ray.get(pending)[0]
        limit = self.spec.trainer.max_consecutive_nonfinite_steps
        self.consecutive_nonfinite = self.consecutive_nonfinite + 1 if metrics["actor/step_skipped"] else 0
        if self.consecutive_nonfinite >= limit:
            raise NonFiniteStepsError(
                f"{self.consecutive_nonfinite} consecutive steps had a non-finite loss or gradient norm "
                f"(trainer.max_consecutive_nonfinite_steps={limit}); stopping with the last good checkpoint intact"
            )
        return metrics

    def offload_train_state(self) -> None:
        """Every rank gives its device to colocated engines (``ActorWorker.offload_train_state``)."""
        self._all("offload_train_state")

    def onload_train_state(self) -> None:
        """Every rank takes its device back for the update."""
        self._all("onload_train_state")

    def transitions(self) -> list[tuple[float, str]]:
        """Rank 0's recent (wall time, event) pairs: logprobs, train, offload, onload, sync."""
        self.wait_ready()
        return ray.get(self.workers[0].get_transitions.remote())

    def state_dict(self) -> dict[str, int]:
        """The group's driver-side state, saved with the trainer's in each checkpoint."""
        return {"consecutive_nonfinite": self.consecutive_nonfinite}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.consecutive_nonfinite = int(state.get("consecutive_nonfinite", 0))

    def save_checkpoint(self, directory: str, trainer_state: dict[str, Any] | None = None) -> str:
        return self._all("save_checkpoint", str(directory), trainer_state)

    def load_checkpoint(self, directory: str) -> dict[str, Any]:
        """Resume the actor from a training checkpoint (the reference keeps the initial weights)."""
        return self._all("load_checkpoint", str(directory))

    def load_initial_weights(self, source: str) -> None:
        """The run's initial weights (HF directory or Megatron checkpoint) into actor and reference."""
        self._all("load_initial_weights", str(source))

    def weight_metadata(self, dtype: str = "float32", *, fp8: bool = False) -> list[TensorMeta]:
        """Every HF-named tensor a sync sends, in order, in ``dtype`` (``fp8``: projection
        weights as FP8 plus their block scales)."""
        self.wait_ready()
        return ray.get(self.workers[0].weight_metadata.remote(dtype, fp8))

    def weight_buckets(
        self, bucket_bytes: int, *, dtype: str = "float32", max_buffered: int = 2, fp8: bool = False
    ) -> Iterator[Any]:
        """ObjectRefs of the model's weight buckets (HF names, ``dtype``), produced lazily by
        rank 0: rank 0 runs at most ``max_buffered`` buckets ahead of the consumer
        (``RolloutPool.sync``). Consume to the end: every rank takes part in the gathers."""
        self.wait_ready()
        streams = [
            w.stream_weight_buckets.options(
                num_returns="streaming", _generator_backpressure_num_objects=max_buffered
            ).remote(bucket_bytes, dtype, fp8)
            for w in self.workers
        ]
        yield from streams[0]
        for stream in streams[1:]:
            for ref in stream:  # none: other ranks only gather; raises if a rank failed
                ray.get(ref)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return self._all("hf_state_dict")

    def sender_address(self) -> tuple[str, int]:
        """Rank 0's IP and a free port there: where a transfer group's rendezvous is hosted."""
        return ray.get(self.workers[0].address.remote())

    def open_weight_sender(
        self, backend: str, client: Any, init: dict[str, Any], *, dtype: str, bucket_bytes: int, fp8: bool = False
    ) -> None:
        """Every rank builds its sender; rank 0 joins the engines behind ``client``."""
        self._all("open_weight_sender", backend, client, init, dtype, bucket_bytes, fp8)

    def send_weights(self) -> Any:
        """One version through the open transfer group; rank 0's sender's result."""
        return self.finish_send_weights(self.submit_send_weights())

    def submit_send_weights(self) -> list[Any]:
        """:meth:`send_weights` queued on every rank behind what was submitted before (an
        update); returns at once, with the pending results."""
        return self._submit("send_weights")

    def finish_send_weights(self, pending: list[Any]) -> Any:
        """Wait for a :meth:`submit_send_weights`; rank 0's result."""
        return ray.get(pending)[0]

    def close_weight_sender(self) -> None:
        self._all("close_weight_sender")

    def write_hf_weights(self, directory: str, *, dtype: str) -> None:
        """The model's HF safetensors into ``directory`` (streamed by rank 0)."""
        self._all("write_hf_weights", str(directory), dtype)

    def node_ids(self) -> list[str]:
        """The Ray node id of every rank, in rank order."""
        self.wait_ready()
        return ray.get([w.node_id.remote() for w in self.workers])

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
        self.workers = []
