"""The weights half of :class:`~megatron_rl.rollout.pool.pool.RolloutPool`: one version into
every live engine (object-store buckets, a sender's transfer group, or LoRA adapters), and a
restarted engine brought back to the pool's version.

A sync is one version for every live engine: :meth:`PoolWeights.begin_update` (every engine
checks the version's metadata; a refusal raises before anything moves), then the tensors,
then :meth:`PoolWeights.commit_update`. The tensors come through Ray's object store
(:meth:`PoolWeights.sync`) or from a sender's transfer group the engines join
(:meth:`PoolWeights.client`; ``megatron_rl.weight_sync``). With ``rollout.lora_sync:
adapter`` a version may be the actor's LoRA adapters alone (:meth:`PoolWeights.load_adapter`,
over the base weights each engine holds); a restored engine takes the last ones too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from megatron_rl.config.rollout import RolloutConfig
from megatron_rl.rollout.pool.recovery import RolloutEngineError, actor_errors
from megatron_rl.weight_sync.adapters import AdapterUpdate
from megatron_rl.weight_sync.buckets import WeightBucket, sync_stats
from megatron_rl.weight_sync.client import EngineGroupClient, TransferFailedError, gather_calls
from megatron_rl.weight_sync.meta import TensorMeta

__all__ = ["PoolWeights"]

logger = logging.getLogger(__name__)


class PoolWeights:
    """Weight versions into the pool's engines; :class:`~megatron_rl.rollout.pool.pool.RolloutPool`
    provides the engines (``actors``, ``engine_names``, ``live_engines``, ``_dead``), the
    ``config`` and the recovery (``_recover_all``, ``restart``)."""

    config: RolloutConfig
    actors: list[Any]
    engine_names: list[str]
    num_engines: int
    live_engines: list[int]
    _dead: dict[int, str]
    _version: int
    _restore_refs: list[Any]
    _restore_metas: list[TensorMeta]
    _adapter: Any
    restorer: Callable[[list[int]], None] | None
    _recover_all: Callable[..., None]
    restart: Callable[..., None]

    def _restore(self, engines: list[int]) -> None:
        """Bring restarted ``engines`` to the pool's weight version (and its adapters)."""
        if self.restorer is not None:
            self.restorer(engines)
        elif not self._restore_refs:
            raise RolloutEngineError(
                f"{', '.join(self.engine_names[e] for e in engines)} restarted with the initial weights but the pool "
                f"is at version {self._version} and keeps no weights to restore (keep_weights_for_restart=False)"
            )
        else:
            self._load_refs(self._restore_refs, self._restore_metas, self._version, engines)
        if self._adapter is not None:
            self._load_adapter_into(engines, self._version, self._adapter)

    def client(self, engines: Sequence[int] | None = None) -> EngineGroupClient:
        """The weight-sync client of ``engines`` (default: every live engine) for a sender."""
        import ray

        targets = list(self.live_engines if engines is None else engines)
        health = ray.get([self.actors[i].health.remote() for i in targets], timeout=self.config.pool.restart_timeout_s)
        return EngineGroupClient(
            actors=[self.actors[i] for i in targets], engines=targets, names=list(self.engine_names),
            receivers=[int(h["weight_receivers"]) for h in health], timeout_s=self.config.pool.weight_sync_timeout_s,
        )  # fmt: skip

    def begin_update(self, version: int, metas: list[TensorMeta], *, engines: Sequence[int] | None = None) -> list[int]:
        """Open the update to ``version`` (tensors ``metas``) on ``engines`` (default: every
        live engine); returns them. Every engine checks ``metas`` first: a refusal raises
        :class:`RolloutEngineError` naming the engine and the version, and every engine
        keeps its weights."""
        targets = list(self.live_engines if engines is None else engines)
        refs = {i: self.actors[i].begin_weight_update.remote(int(version), metas) for i in targets}
        try:
            self._gather(refs, f"opening weight update to version {version}")
        except RolloutEngineError:
            self.abort_update(targets)
            raise
        return targets

    def commit_update(self, version: int, engines: Sequence[int]) -> None:
        """Close the open update on ``engines``; the pool's version becomes ``version``."""
        refs = {i: self.actors[i].commit_weight_update.remote() for i in engines}
        self._expect_version(refs, version, "committing weight version", "committed versions")
        self._version = int(version)

    def abort_update(self, engines: Sequence[int]) -> None:
        """Close a failed update on ``engines`` (best effort; dead engines are skipped)."""
        import ray

        refs = [self.actors[i].abort_weight_update.remote() for i in engines if i not in self._dead]
        ray.wait(refs, num_returns=len(refs), timeout=self.config.pool.restart_timeout_s)

    def _expect_version(self, refs: dict[int, Any], version: int, doing: str, done: str) -> None:
        """Wait for calls that each return the engine's new version; all must be ``version``."""
        versions = self._gather(refs, f"{doing} {version}")
        if any(v != version for v in versions):
            raise RolloutEngineError(f"engines {done} {versions}, expected {version}")

    def _gather(self, refs: dict[int, Any], what: str) -> list[Any]:
        try:
            return gather_calls(refs, self.engine_names, what, timeout_s=self.config.pool.weight_sync_timeout_s)
        except TransferFailedError as exc:
            raise RolloutEngineError(str(exc)) from exc

    def sync(
        self, buckets: Iterable[WeightBucket | Any], *, version: int, metas: list[TensorMeta]
    ) -> dict[str, float]:
        """One version through the object store: every live engine loads ``buckets``.

        Args:
            buckets: the model's :class:`~megatron_rl.weight_sync.buckets.WeightBucket` s, or
                ObjectRefs of buckets a producer already put (the actor's rank 0 does);
                consumed once, lazily, so a producer runs at most one bucket ahead of the
                ``rollout.pool.max_inflight_buckets`` being loaded.
            version: the weight version the engines report afterwards.
            metas: every tensor of the buckets, in order (checked by every engine first).

        An engine that dies during the sync is restarted and brought to ``version`` at
        the end. An engine that raises makes the sync raise :class:`RolloutEngineError`
        naming it and the version; every engine's update is then aborted (engines that
        had received tensors report ``ok: False`` until the next sync commits).

        Returns:
            ``weight_sync/seconds`` (wall time, producer included), ``weight_sync/put_seconds``
            (host copies + ``ray.put`` here), ``weight_sync/bytes`` (payload bytes per
            engine), ``weight_sync/num_tensors``, ``weight_sync/num_buckets``,
            ``weight_sync/num_engines``, ``weight_sync/gib_per_s``, ``weight_sync/version``.
        """
        import ray

        start = time.perf_counter()
        if version < self._version:
            logger.warning("weight sync to version %d is older than the pool's %d", version, self._version)
        targets = self.begin_update(version, metas)
        # The previous sync's buckets are no longer what a restarted engine should get
        # (this sync's are, at the end); dropping them now keeps one model copy at most.
        self._restore_refs, self._restore_metas = [], []
        failed: set[int] = set()  # died or hung: no more buckets; brought back at the end
        hung: set[int] = set()
        put_seconds = 0.0
        refs: list[ray.ObjectRef] = []
        inflight: list[list[tuple[int, ray.ObjectRef]]] = []
        try:
            for bucket in buckets:
                while len(inflight) >= self.config.pool.max_inflight_buckets:
                    self._wait_loads(inflight.pop(0), failed, hung, version)
                t0 = time.perf_counter()
                ref = ray.put(bucket) if isinstance(bucket, WeightBucket) else bucket
                del bucket  # the object store holds the only copy from here on
                put_seconds += time.perf_counter() - t0
                inflight.append([(i, self.actors[i].load_bucket.remote(ref)) for i in targets if i not in failed])
                refs.append(ref)
            for loads in inflight:
                self._wait_loads(loads, failed, hung, version)
        except BaseException:
            self.abort_update([i for i in targets if i not in failed])
            raise
        self.commit_update(version, [i for i in targets if i not in failed])
        self._restore_refs, self._restore_metas = list(refs), list(metas)
        self._recover_all(failed - hung)
        if hung:
            self.restart(hung)
        if not self.config.pool.keep_weights_for_restart:
            self._restore_refs, self._restore_metas = [], []
        return sync_stats(time.perf_counter() - start, put_seconds=put_seconds, metas=metas, num_buckets=len(refs),
                          num_engines=self.num_engines, version=version)  # fmt: skip

    def load_adapter(self, version: int, update: AdapterUpdate) -> dict[str, float]:
        """Every live engine generates with the actor's LoRA adapters ``update`` over the base
        weights it holds (``rollout.lora_sync: adapter``); the pool's version becomes ``version``.
        An engine that fails raises :class:`RolloutEngineError` naming it and the version."""
        import ray

        start = time.perf_counter()
        ref = ray.put(update)
        self._load_adapter_into(self.live_engines, version, ref)
        self._version, self._adapter = int(version), ref
        return {"weight_sync/adapter_seconds": time.perf_counter() - start,
                "weight_sync/adapter_bytes": float(update.num_bytes)}  # fmt: skip

    def _load_adapter_into(self, engines: Sequence[int], version: int, ref: Any) -> None:
        refs = {i: self.actors[i].load_adapter.remote(int(version), ref) for i in engines}
        self._expect_version(refs, version, "loading the adapters of version", "loaded adapters of versions")

    def _wait_loads(self, loads: list[tuple[int, Any]], failed: set[int], hung: set[int], version: int) -> None:
        """Wait for one bucket's loads; an engine that died, or hangs for ``weight_sync_timeout_s``
        (it is restarted), is brought back at the end."""
        import ray

        for engine, ref in loads:
            if engine in failed:  # hung on an earlier bucket: its later loads wait behind it
                continue
            try:
                ray.get(ref, timeout=self.config.pool.weight_sync_timeout_s)
            except ray.exceptions.GetTimeoutError:
                logger.warning("%s loaded no bucket in weight_sync_timeout_s=%g; it is restarted at the end",
                               self.engine_names[engine], self.config.pool.weight_sync_timeout_s)  # fmt: skip
                failed.add(engine)
                hung.add(engine)
            except actor_errors() as exc:
                logger.warning("%s died during a weight sync (%s); it is restored at the end", self.engine_names[engine],
                               exc)  # fmt: skip
                failed.add(engine)
            except ray.exceptions.RayTaskError as exc:
                raise RolloutEngineError(
                    f"{self.engine_names[engine]} failed to load weight version {version}: {exc}"
                ) from exc

    def _load_refs(self, refs: list[Any], metas: list[TensorMeta], version: int, engines: list[int]) -> None:
        """One version from buckets already in the object store into ``engines``."""
        import ray

        targets = self.begin_update(version, metas, engines=engines)
        try:
            ray.get([self.actors[i].load_bucket.remote(ref) for ref in refs for i in targets])
        except BaseException:
            self.abort_update(targets)
            raise
        self.commit_update(version, targets)
