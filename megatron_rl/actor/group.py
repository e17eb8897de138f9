"""The Megatron actor's ranks driven as one group by the trainer.

:class:`ActorGroup` starts ``parallel.num_actor_ranks`` :class:`~megatron_rl.actor.worker.ActorWorker`
Ray actors where :mod:`megatron_rl.cluster.placement` says, and runs each call on every
rank (the actor's methods are collective), returning rank 0's result.

The group also keeps the run's non-finite rule: a step whose updates were skipped for a
non-finite loss or gradient norm is counted, and ``trainer.max_consecutive_nonfinite_steps``
of them in a row raise :class:`NonFiniteStepsError` (the counter is saved with the
driver's state in every checkpoint). Every wait on the ranks is bounded by
``actor.call_timeout_s``: a rank that hangs raises :class:`ActorCallTimeoutError` naming
the ranks and the call, instead of hanging the run without a word; a rank that failed
meanwhile raises its own error first.
"""


from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import ray
import torch

from megatron_rl.actor.actor import LogProbs
from megatron_rl.actor.batch import ActorBatch
from megatron_rl.actor.model import load_hf_config
from megatron_rl.actor.spec import ActorSpec
from megatron_rl.actor.worker import ActorWorker
from megatron_rl.cluster.placement import GroupPlacement
from megatron_rl.cluster.planner import Architecture, stage_parameters
from megatron_rl.weight_sync.meta import TensorMeta

__all__ = ["ActorCallTimeoutError", "ActorGroup", "NonFiniteStepsError", "default_call_timeout_s"]

logger = logging.getLogger(__name__)

MIN_CALL_TIMEOUT_S = 1800.0
"""The default call time-out's floor: the longest update or sync a run should need."""

CHECKPOINT_BYTES_PER_PARAMETER = 16
"""Bytes a rank writes per parameter it holds (float32 weights and main copy, Adam's two moments)."""

SLOW_WRITE_BYTES_PER_S = 50 << 20
"""A slow shared file system, per rank: what the default call time-out allows a checkpoint."""


FAILED_RANK_GRACE_S = 30.0
"""How long the other ranks may take to finish (or fail) a call after one rank failed in it."""


class NonFiniteStepsError(RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradient norm."""


class ActorCallTimeoutError(RuntimeError):
    """Actor ranks did not finish a call within ``actor.call_timeout_s``."""


def default_call_timeout_s(architecture: Any, *, tp: int, pp: int) -> float:
    """``actor.call_timeout_s`` when it is null: :data:`MIN_CALL_TIMEOUT_S` plus the largest
    rank's share of a checkpoint of the ``architecture`` model (an ``ActorSpec.architecture``:
    a HF directory, its ``config.json``, a dict) at TP ``tp`` x PP ``pp``, written at
    :data:`SLOW_WRITE_BYTES_PER_S`."""
    arch = Architecture.from_hf_config(load_hf_config(architecture))
    params = max(stage_parameters(arch, tp=tp, pp=pp, stage=stage) for stage in range(pp))
    return MIN_CALL_TIMEOUT_S + params * CHECKPOINT_BYTES_PER_PARAMETER / SLOW_WRITE_BYTES_PER_S


class ActorGroup:
    """The actor's ranks (``spec.parallel.num_actor_ranks`` :class:`ActorWorker` Ray actors)
    forming one Megatron world.

    Args:
        spec: what every rank builds (sent once, at construction).
        placement: where each rank runs (:mod:`megatron_rl.cluster.placement`); default: Ray's own
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
        self._use_spec(spec)
        self.broken: str | None = None
        """Why the group cannot run calls any more (a call timed out, or a rank failed while
        the others waited for it in a collective); only :meth:`shutdown` runs then."""
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

    def _use_spec(self, spec: ActorSpec) -> None:
        self.spec = spec
        self.call_timeout_s = spec.actor.call_timeout_s or default_call_timeout_s(
            spec.architecture, tp=spec.parallel.tensor_model_parallel_size, pp=spec.parallel.pipeline_model_parallel_size
        )

    def rebuild(self, spec: ActorSpec, *, wait: bool = True) -> None:
        """Build the actor again from ``spec`` in the same rank processes, which keep their
        torch.distributed world: the old model, optimizer, reference and weight sender go;
        a new layout replaces the parallel state (``launch.initialize_parallel``), and every
        rank is seeded from ``spec`` as a fresh group's would be. ``spec`` must have as many
        ranks. Starting a rank costs seconds of imports (megatron-core, transformers); code
        that compares several specs on one set of ranks (the tests) pays that once."""
        if spec.parallel.num_actor_ranks != len(self.workers):
            raise ValueError(f"rebuild needs {len(self.workers)} actor ranks, the spec has {spec.parallel.num_actor_ranks}")
        self.wait_ready()
        self._check_usable("rebuild")
        self._use_spec(spec)
        self.consecutive_nonfinite = 0
        self._setup = [w.setup.remote(None, spec) for w in self.workers]
        if wait:
            self.wait_ready()

    def answers(self, *, timeout_s: float) -> bool:
        """Whether the group is usable and every rank answers a trivial call within
        ``timeout_s`` (a rank that is dead, or still in a call, does not)."""
        if self.broken is not None or not self.workers:
            return False
        try:
            pending = [w.node_id.remote() for w in self.workers]
            if ray.wait(pending, num_returns=len(pending), timeout=timeout_s)[1]:
                return False
            ray.get(pending)  # a dead rank's call raises
            return True
        except ray.exceptions.RayError:
            return False

    def wait_ready(self) -> None:
        """Wait until every rank has built its model; raises the first rank's failure."""
        pending, self._setup = self._setup, None
        if pending:
            self._get(pending, "setup")

    def _get(self, pending: list[Any], call: str) -> list[Any]:
        """``ray.get(pending)`` (one call's result per rank, in rank order), bounded by
        ``actor.call_timeout_s``: a rank's failure raises as soon as it arrives; ranks that
        have not answered by then raise :class:`ActorCallTimeoutError` naming them and ``call``."""
        self._check_usable(call)
        waiting, deadline = list(pending), time.monotonic() + self.call_timeout_s
        while waiting:
            ready, waiting = ray.wait(waiting, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self._hung([pending.index(ref) for ref in waiting], call)
            try:
                ray.get(ready)  # a rank's failure: raised now, not after the others' time-out
            except Exception:
                # Ranks still in the call after a grace period wait for the failed one in a
                # collective: no later call could run, so none is tried (the clean-up included).
                if waiting and ray.wait(waiting, num_returns=len(waiting), timeout=FAILED_RANK_GRACE_S)[1]:
                    self.broken = f"actor rank {pending.index(ready[0])} failed in {call}() while the others waited"
                raise
        return ray.get(pending)

    def _check_usable(self, call: str) -> None:
        if self.broken is not None:  # a hung or failed rank blocks every later call: do not wait again
            raise ActorCallTimeoutError(f"{call}() not run: {self.broken}")

    def _hung(self, ranks: list[int], call: str) -> None:
        """Mark the group unusable and raise: ``ranks`` did not finish ``call`` in time."""
        self.broken = (f"actor rank(s) {ranks} did not finish {call}() within {self.call_timeout_s:g} s "
                       "(actor.call_timeout_s): hung (a stopped process, a deadlocked collective, a "
                       "stalled file system?)")  # fmt: skip
        raise ActorCallTimeoutError(self.broken + "; rerun the same command to resume from the last checkpoint")

    def _stream(self, stream: Any, rank: int, call: str) -> Iterator[Any]:
        """The ObjectRefs of rank ``rank``'s streaming ``call``, each bounded by
        ``actor.call_timeout_s`` from the moment it is asked for (the consumer's own time,
        e.g. engines loading a bucket, does not count: the producer waits on backpressure)."""
        while True:
            self._check_usable(call)
            if not ray.wait([stream], timeout=self.call_timeout_s)[0]:
                self._hung([rank], call)
            try:
                yield next(stream)
            except StopIteration:
                return

    def _all(self, method: str, *args, **kwargs) -> Any:
        """Run ``method`` on every rank (collective); rank 0's result."""
        return self._get(self._submit(method, *args, **kwargs), method)[0]

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

    def sft_step(self, batch: ActorBatch) -> dict[str, float]:
        """One supervised optimizer step on ``batch`` on every rank (``MegatronActor.sft_step``:
        the response tokens' mean negative log-likelihood); its metrics. Non-finite steps
        count toward ``trainer.max_consecutive_nonfinite_steps`` as RL updates do."""
        return self._check_nonfinite(self._get(self._submit("sft_step", self._shared(batch)), "sft_step")[0])

    def finish_update(self, pending: list[Any]) -> dict[str, float]:
        """Wait for a :meth:`submit_update`; its metrics (see :meth:`update_policy`)."""
        return self._check_nonfinite(self._get(pending, "update_policy")[0])

    def _check_nonfinite(self, metrics: dict[str, float]) -> dict[str, float]:
        """Count a skipped update; raise :class:`NonFiniteStepsError` at the limit."""
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
        return self._get([self.workers[0].get_transitions.remote()], "get_transitions")[0]

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
        return self._get([self.workers[0].weight_metadata.remote(dtype, fp8)], "weight_metadata")[0]

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
        yield from self._stream(streams[0], 0, "stream_weight_buckets")
        for rank, stream in enumerate(streams[1:], start=1):
            for ref in self._stream(stream, rank, "stream_weight_buckets"):  # none: other ranks only gather
                ray.get(ref)  # raises if the rank failed

    def adapter_update(self) -> Any:
        """The LoRA adapters of the whole model, gathered to rank 0 (``rollout.lora_sync:
        adapter``): a ``weight_sync.adapters.AdapterUpdate``."""
        return self._all("adapter_update")

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return self._all("hf_state_dict")

    def sender_address(self) -> tuple[str, int]:
        """Rank 0's IP and a free port there: where a transfer group's rendezvous is hosted."""
        return self._get([self.workers[0].address.remote()], "address")[0]

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
        return self._get(pending, "send_weights")[0]

    def close_weight_sender(self) -> None:
        self._all("close_weight_sender")

    def node_ids(self) -> list[str]:
        """The Ray node id of every rank, in rank order."""
        self.wait_ready()
        return self._get([w.node_id.remote() for w in self.workers], "node_id")

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
        self.workers = []
