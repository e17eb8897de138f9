"""The run's one weight-sync path: the actor's weights into every rollout engine, one version at a time.

Every sync, whatever the transport (``rollout.weight_transport``, resolved by
:func:`resolve_transport`):

1. every live engine checks the version's metadata (HF names, shapes, the engines'
   dtype) and opens its update (``RolloutPool.begin_update``); a refusal names the
   engine and the version, and nothing has moved;
2. the tensors move: through the object store (rank 0 streams buckets, the pool loads
   them: ``RolloutPool.sync``), through a host shared-memory file (rank 0 writes it,
   the pool hands its descriptor to the engines as their one bucket:
   ``weight_sync.transports.shm``), or through a transfer group of actor rank 0 and every
   engine worker (``ActorGroup.send_weights``: ``gloo`` on host memory, vLLM's ``nccl``
   between GPUs, vLLM's ``ipc`` for colocated GPUs);
3. every engine commits the version (``RolloutPool.commit_update``).

A LoRA actor with ``rollout.lora_sync: adapter`` sends the frozen base weights that way
only at the first sync and after an engine restart (or an engine off the pool's version); every sync
then gathers the adapters to actor rank 0 (``ActorGroup.adapter_update``) and the engines
load them through the object store (``RolloutPool.load_adapter``; ``weight_sync.adapters``).

A failure in 2 or 3 aborts every engine's update; engines that had received tensors
(or died) are restarted, the group is rebuilt, and the sync runs once more; a second
failure raises :class:`WeightSyncError` naming the version and the cause. An engine that
Ray restarts later (during generation) is brought to the pool's version by
:meth:`WeightSync.restore`, through a group of its own.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from megatron_rl.config.lib import ConfigError
from megatron_rl.config.rollout import RolloutConfig
from megatron_rl.weight_sync.meta import TensorMeta

__all__ = ["WeightSync", "WeightSyncError", "resolve_transport"]

logger = logging.getLogger(__name__)

# How the engines receive: buckets for both host transports (a shared-memory descriptor
# is loaded as a bucket), a transfer group otherwise.
_BACKEND = {"object_store": "object_store", "shared_memory": "object_store", "cuda_ipc": "ipc"}


class WeightSyncError(RuntimeError):
    """A weight sync failed twice (the message names the version and the last cause)."""


def resolve_transport(rollout: RolloutConfig, engine: type, *, cuda: bool) -> tuple[str, str]:
    """``(transport, backend)`` of a run: ``rollout.weight_transport`` with ``auto`` resolved,
    and the transfer backend the engines receive through. ``engine`` is the engine class
    (``rollout.pool.worker.engine_class(rollout.engine)``), read for what it can receive
    (``weight_backends``, ``weight_formats``, ``tensor_parallel``).

    Raises:
        ConfigError: (``rollout.weight_transport``) the engine cannot receive through it,
            or it needs GPUs the run does not have.
    """
    colocated = rollout.placement == "colocated"
    transport = rollout.weight_transport
    cls = engine
    if transport == "auto":
        if not cuda:
            transport = "shared_memory"  # WeightSync falls back to object_store across nodes
        elif colocated and "ipc" in cls.weight_backends:
            transport = "cuda_ipc"
        else:
            transport = "collective"
    if transport == "cuda_ipc" and not cuda:
        raise ConfigError("rollout.weight_transport", "cuda_ipc needs CUDA GPUs; this run has none")
    if transport == "collective":
        backend = "nccl" if cuda and "nccl" in cls.weight_backends else "gloo"
    else:
        backend = _BACKEND[transport]
    if rollout.tensor_parallel_size > 1 and not cls.tensor_parallel:
        raise ConfigError("rollout.tensor_parallel_size", f"{rollout.tensor_parallel_size}: rollout.engine "
                          f"{rollout.engine!r} has no tensor parallelism (use 1, or the vllm engine)")  # fmt: skip
    if rollout.lora_sync == "adapter" and not cls.lora_adapters:
        raise ConfigError("rollout.lora_sync", f"adapter: rollout.engine {rollout.engine!r} loads no LoRA adapters "
                          "(use merged, or the vllm engine)")  # fmt: skip
    if rollout.weight_dtype not in cls.weight_formats:
        raise ConfigError(
            "rollout.weight_dtype",
            f"{rollout.weight_dtype!r} is not supported by rollout.engine {rollout.engine!r}, which reads "
            f"{list(cls.weight_formats)}",
        )
    if backend not in cls.weight_backends:
        raise ConfigError(
            "rollout.weight_transport",
            f"{transport!r} (backend {backend!r}) is not supported by rollout.engine {rollout.engine!r}, which "
            f"receives through {list(cls.weight_backends)}",
        )
    return transport, backend


class WeightSync:
    """Drives every sync of a run (see the module docstring).

    Args:
        actors: the actor group (``actor.group.ActorGroup``).
        pool: the engines (``rollout.pool.RolloutPool``), started with ``backend``.
        rollout: the run's ``rollout`` section.
        transport, backend: from :func:`resolve_transport`.
    """

    def __init__(self, actors: Any, pool: Any, rollout: RolloutConfig, *, transport: str, backend: str):
        self.actors, self.pool, self.rollout = actors, pool, rollout
        self.transport, self.backend = transport, backend
        self.bucket_bytes = rollout.weight_sync_bucket_mb << 20
        # Every live engine reports its dtype, those still waiting for their first weights too.
        dtypes = {h["weight_dtype"] for h in pool.health() if "weight_dtype" in h}
        if len(dtypes) != 1:
            raise RuntimeError(f"the engines load weights in different dtypes: {sorted(dtypes)}")
        self.dtype = dtypes.pop()
        self.fp8 = rollout.weight_dtype == "fp8"  # projection weights as block-wise FP8 (weight_sync.fp8)
        self.metas: list[TensorMeta] = actors.weight_metadata(self.dtype, fp8=self.fp8)
        self._group_key: tuple | None = None
        self._prepared: tuple[int, list[Any]] | None = None  # (version, the actor's pending write)
        self.adapters = rollout.lora_sync == "adapter"  # base weights once, then adapters only
        self._base_key: int | None = None  # pool.restarts when the base was last sent to every engine
        if transport == "shared_memory":
            self.transport = self._shared_memory_or_fallback()
        # Collective transports keep no host copy: a restarted engine is restored from the
        # actor. The host transports restore from the pool's kept buckets (no restorer):
        # the shared file holds the pool's version between syncs.
        pool.restorer = self.restore if self.transport not in ("object_store", "shared_memory") else None

    def run(self, version: int) -> dict[str, float]:
        """Sync ``version`` into every live engine (retried once after repairing the engines)."""
        start = time.perf_counter()
        retries = 0
        try:
            stats = self._once(version)
        except Exception as exc:
            logger.warning("weight sync to version %d failed (%s); repairing the engines and retrying once", version,
                           exc)  # fmt: skip
            retries = 1
            self._repair()
            try:
                stats = self._once(version)
            except Exception as again:
                raise WeightSyncError(f"weight sync to version {version} failed twice; last: {again}") from again
        seconds = time.perf_counter() - start
        num_bytes = sum(m.num_bytes for m in self.metas) if stats.get("weight_sync/base_sent", 1.0) else 0
        num_bytes += int(stats.get("weight_sync/adapter_bytes", 0))
        return {
            "weight_sync/num_tensors": float(len(self.metas)),
            "weight_sync/num_engines": float(len(self.pool.live_engines)),
            **stats,
            "weight_sync/seconds": seconds,
            "weight_sync/bytes": float(num_bytes),
            "weight_sync/gib_per_s": num_bytes / seconds / (1 << 30) if seconds > 0 else float("inf"),
            "weight_sync/version": float(version),
            "weight_sync/retries": float(retries),
        }

    def _once(self, version: int) -> dict[str, float]:
        if not self.adapters:
            return self._weights_once(version)
        # The base goes to every engine at the first sync, after a restart the pool saw, and
        # when an engine is not at the pool's version (Ray restarted it unseen, mid-sync).
        live, version_now = set(self.pool.live_engines), self.pool.weight_version
        stale = any(h.get("weight_version") != version_now for i, h in enumerate(self.pool.health()) if i in live)
        base_sent = stale or self._base_key != self.pool.restarts
        stats = self._weights_once(version) if base_sent else {}
        self._base_key = self.pool.restarts
        stats.update(self.pool.load_adapter(version, self.actors.adapter_update()))
        return {**stats, "weight_sync/base_sent": float(base_sent)}

    def _weights_once(self, version: int) -> dict[str, float]:
        if self.transport == "object_store":
            buckets = self.actors.weight_buckets(
                self.bucket_bytes, dtype=self.dtype, max_buffered=self.rollout.pool.max_inflight_buckets, fp8=self.fp8
            )  # fmt: skip
            return self.pool.sync(buckets, version=version, metas=self.metas)
        if self.transport == "shared_memory":
            prepared, self._prepared = self._prepared, None
            if prepared is not None and prepared[0] == version:
                shared = self.actors.finish_send_weights(prepared[1])
            else:
                self._open_shared_file()
                shared = self.actors.send_weights()  # rank 0 wrote the file: its descriptor
            return self.pool.sync([shared], version=version, metas=self.metas)
        self._open_group()
        return self._send(version, self.pool.live_engines)

    def prepare(self, version: int) -> None:
        """Queue the actor's write of ``version`` right behind its update, just submitted
        (``shared_memory`` only; nothing otherwise): the actor writes as soon as it has
        updated instead of a round trip of the driver later, into the slot the engines are
        not reading (``weight_sync.transports.shm``); :meth:`run` of ``version`` takes the result."""
        if self.transport == "shared_memory" and not self.adapters:  # adapters: the base is rarely sent
            self._open_shared_file()
            self._prepared = (version, self.actors.submit_send_weights())

    def _open_shared_file(self) -> None:
        """Rank 0 creates the shared file (again after a repair: a fresh file)."""
        if self._group_key is None:
            self.actors.open_weight_sender("shm", None, {}, dtype=self.dtype, bucket_bytes=self.bucket_bytes,
                                           fp8=self.fp8)  # fmt: skip
            self._group_key = ("shm",)

    def _shared_memory_or_fallback(self) -> str:
        """``shared_memory`` when actor rank 0 and every engine share a node and rank 0 can
        create the file; with ``auto`` otherwise ``object_store`` (logged), as set a
        ``ConfigError`` naming why."""
        chosen = self.rollout.weight_transport == "shared_memory"
        actor_node = self.actors.node_ids()[0]
        elsewhere = sorted({n for n in self.pool.node_ids() if n is not None and n != actor_node})
        reason = None
        if elsewhere:
            reason = f"engines run on node(s) {elsewhere}, not on actor rank 0's node {actor_node}"
        else:
            try:
                self._open_shared_file()
            except Exception as exc:  # OSError inside the actor: no /dev/shm, or too small
                reason = f"actor rank 0 cannot create the shared file: {getattr(exc, 'cause', None) or exc}"
        if reason is None:
            return "shared_memory"
        if chosen:
            raise ConfigError("rollout.weight_transport", f"shared_memory: {reason}")
        logger.info("weight transport: object_store (shared_memory needs one node and room in /dev/shm; %s)", reason)
        return "object_store"

    def _send(self, version: int, engines: list[int]) -> dict[str, float]:
        targets = self.pool.begin_update(version, self.metas, engines=engines)
        try:
            self.actors.send_weights()
        except BaseException:
            self.pool.abort_update(targets)
            self._group_key = None  # a failed transfer leaves the group unusable
            raise
        self.pool.commit_update(version, targets)
        return {}

    def _open_group(self, engines: list[int] | None = None) -> None:
        """(Re)build the transfer group when the engines it spans changed."""
        key = (self.pool.restarts, tuple(self.pool.live_engines if engines is None else engines))
        if key == self._group_key:
            return
        client = self.pool.client(engines)
        address, port = self.actors.sender_address()
        init = {
            "master_address": address, "master_port": port, "world_size": client.world_size,
            "chunk_bytes": self.bucket_bytes, "timeout_s": self.rollout.pool.weight_sync_timeout_s,
        }  # fmt: skip
        self.actors.open_weight_sender(
            self.backend, client, init, dtype=self.dtype, bucket_bytes=self.bucket_bytes, fp8=self.fp8
        )  # fmt: skip
        self._group_key = key

    def restore(self, engines: list[int]) -> None:
        """Bring restarted ``engines`` to the pool's version from the actor (whose weights
        are that version between syncs), through a group of their own."""
        self._group_key = None
        self._open_group(list(engines))
        self._send(self.pool.weight_version, list(engines))
        self._group_key = None  # the next sync rebuilds the group over every engine

    def _repair(self) -> None:
        """After a failed sync: close every update; restart engines with mixed weights."""
        live = self.pool.live_engines
        self.pool.abort_update(live)
        bad = [i for i, h in enumerate(self.pool.health()) if i in live and not h.get("ok", False)]
        if bad:
            logger.warning("restarting engines %s after a failed weight sync", [self.pool.engine_names[i] for i in bad])
            self.pool.restart(bad, restore=False)  # the retry brings them to the new version
        self._group_key = None

    def close(self) -> None:
        if self.pool.restorer == self.restore:
            self.pool.restorer = None
        if self.transport != "object_store":
            self.actors.close_weight_sender()
