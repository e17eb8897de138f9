"""The Megatron actor's ranks as Ray actors, driven as one group by the trainer.

Every rank is a Ray actor process running one :class:`~megatron_rl.actor.actor.MegatronActor`.
The group is started in two phases: the workers are created (where
:mod:`megatron_rl.placement` says), rank 0 reports its node's address and a free port,
then every rank joins the same ``torch.distributed`` group (gloo on CPU, NCCL on GPU)
and builds its model from the same :class:`~megatron_rl.actor.spec.ActorSpec`, received
once. Each call of the group runs the same method on every rank (the actor's methods are
collective) and returns rank 0's result.

When the loss has a KL term each rank also holds a frozen copy of the initial policy for
the reference log-probs: a second ``MegatronActor`` built from the same spec and seed
(so the same initial weights); its optimizer is never stepped.

The group also keeps the run's non-finite rule: a step whose updates were skipped for a
non-finite loss or gradient norm is counted, and ``trainer.max_consecutive_nonfinite_steps``
of them in a row raise :class:`NonFiniteStepsError` (the counter is saved with the
driver's state in every checkpoint).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from typing import Any

import ray
import torch

from megatron_rl.actor.actor import LogProbs
from megatron_rl.actor.batch import ActorBatch
from megatron_rl.actor.spec import ActorSpec
from megatron_rl.placement import GroupPlacement
from megatron_rl.weight_buckets import WeightBucket, make_buckets

__all__ = ["ActorGroup", "ActorWorker", "NonFiniteStepsError"]


class NonFiniteStepsError(RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradient norm."""


class ActorWorker:
    """One rank of the actor group (constructed by Ray; see :class:`ActorGroup`)."""

    def __init__(self, *, rank: int, world_size: int, torch_threads: int):
        self.rank = rank
        self.world_size = world_size
        if not torch.cuda.is_available():
            torch.set_num_threads(torch_threads)
        self.actor = None
        self.reference = None

    def node_id(self) -> str:
        """The Ray node this rank runs on (hex id)."""
        return ray.get_runtime_context().get_node_id()

    def address(self) -> tuple[str, int]:
        """This node's IP and a free TCP port (asked of rank 0 for the rendezvous)."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, *, master_addr: str, master_port: int, spec: ActorSpec) -> None:
        from megatron_rl.actor.actor import MegatronActor
        from megatron_rl.actor.launch import init_process_group, initialize_parallel

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
            self.reference = MegatronActor(spec, groups=groups)

    def compute_logprobs(self, batch: ActorBatch, policy: str = "actor") -> LogProbs:
        model = self.reference if policy == "reference" else self.actor
        if model is None:
            raise RuntimeError(f"no {policy!r} model on this actor group (the loss has no KL term)")
        return model.compute_logprobs(batch)

    def update_policy(self, batch: ActorBatch, step: int, token_stats: bool) -> dict[str, float]:
        from megatron_rl.actor.update import update_policy

        return update_policy(self.actor, self.reference, batch, step=step, token_stats=token_stats)

    def save_checkpoint(self, directory: str, trainer_state: dict[str, Any] | None) -> str:
        return str(self.actor.save_checkpoint(directory, trainer_state=trainer_state))

    def load_checkpoint(self, directory: str) -> dict[str, Any]:
        return self.actor.load_checkpoint(directory)

    def load_hf_weights(self, directory: str) -> int:
        count = self.actor.load_hf_weights(directory)
        if self.reference is not None:
            self.reference.load_hf_weights(directory)
        return count

    def stream_weight_buckets(self, bucket_bytes: int) -> Iterator[WeightBucket]:
        """Gather full HF-named tensors (collective on every rank) and, on rank 0, yield them
        in buckets; run as a Ray streaming generator, each bucket lands in the object
        store as it is yielded. Other ranks take part in the gathers and yield nothing."""
        named = self.actor.iter_hf_weights(bucket_bytes=bucket_bytes)
        if self.rank != 0:
            for _ in named:  # every rank takes part in the gathers
                pass
            return
        yield from make_buckets(named, bucket_bytes)

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
    """

    def __init__(self, spec: ActorSpec, placement: GroupPlacement | None = None):
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
        addr, port = ray.get(self.workers[0].address.remote())
        self._all("setup", master_addr=addr, master_port=port, spec=spec)

    def _all(self, method: str, *args, **kwargs) -> Any:
        """Run ``method`` on every rank (collective); rank 0's result."""
        refs = [getattr(w, method).remote(*args, **kwargs) for w in self.workers]
        return ray.get(refs)[0]

    def compute_logprobs(self, batch: ActorBatch, *, policy: str = "actor") -> LogProbs:
        """Per-token log-probs and entropies of ``batch`` (``policy``: actor or reference)."""
        return self._all("compute_logprobs", ray.put(batch), policy)

    def update_policy(self, batch: ActorBatch, step: int, *, token_stats: bool = False) -> dict[str, float]:
        """RL step ``step``'s whole update on ``batch`` (see ``actor/update.py``); its metrics.

        Raises :class:`NonFiniteStepsError` once ``trainer.max_consecutive_nonfinite_steps``
        steps in a row had a skipped (non-finite) update."""
        metrics = self._all("update_policy", ray.put(batch), step, token_stats)
        limit = self.spec.trainer.max_consecutive_nonfinite_steps
        self.consecutive_nonfinite = self.consecutive_nonfinite + 1 if metrics["actor/step_skipped"] else 0
        if self.consecutive_nonfinite >= limit:
            raise NonFiniteStepsError(
                f"{self.consecutive_nonfinite} consecutive steps had a non-finite loss or gradient norm "
                f"(trainer.max_consecutive_nonfinite_steps={limit}); stopping with the last good checkpoint intact"
            )
        return metrics

    def state_dict(self) -> dict[str, int]:
        """The group's driver-side state, saved with the trainer's in each checkpoint."""
        return {"consecutive_nonfinite": self.consecutive_nonfinite}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.consecutive_nonfinite = int(state.get("consecutive_nonfinite", 0))

    def save_checkpoint(self, directory: str, trainer_state: dict[str, Any] | None = None) -> str:
        return self._all("save_checkpoint", str(directory), trainer_state)

    def load_checkpoint(self, directory: str) -> dict[str, Any]:
        return self._all("load_checkpoint", str(directory))

    def load_hf_weights(self, directory: str) -> int:
        return self._all("load_hf_weights", str(directory))

    def weight_buckets(self, bucket_bytes: int, *, max_buffered: int = 2) -> Iterator[Any]:
        """ObjectRefs of the model's weight buckets (HF names), produced lazily by rank 0:
        rank 0 runs at most ``max_buffered`` buckets ahead of the consumer
        (``RolloutPool.sync``). Consume to the end: every rank takes part in the gathers."""
        streams = [
            w.stream_weight_buckets.options(
                num_returns="streaming", _generator_backpressure_num_objects=max_buffered
            ).remote(bucket_bytes)
            for w in self.workers
        ]
        yield from streams[0]
        for stream in streams[1:]:
            for ref in stream:  # none: other ranks only gather; raises if a rank failed
                ray.get(ref)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return self._all("hf_state_dict")

    def node_ids(self) -> list[str]:
        """The Ray node id of every rank, in rank order."""
        return ray.get([w.node_id.remote() for w in self.workers])

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
        self.workers = []
