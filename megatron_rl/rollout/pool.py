"""A pool of rollout engines running as Ray actors: dispatch, retries, and the weight sync.

``RolloutPool.generate(prompts, params)`` splits the prompts into requests (contiguous
prompt ranges, the ``n`` samples of a prompt always in the same request), sends each to
the live engine with the least outstanding work (estimated tokens: prompt tokens plus
``n * max_new_tokens`` per prompt, at most ``rollout.pool.max_inflight_requests_per_engine``
requests queued per engine so a faster engine takes more of them), and returns the
completions in prompt order. Prompt seeds are derived from a prompt's position in the
whole call, so results do not depend on which engine served which prompt.

Failures. Engines are Ray actors with ``max_restarts`` (Ray re-runs the constructor,
which reloads the *initial* checkpoint) and ``max_task_retries=0``: the pool, not Ray,
decides what to retry, because a restarted engine must first get the current weights
back. When a request fails because its engine died (or exceeded ``request_timeout_s``,
in which case the pool kills it so Ray restarts it), the pool waits for the engine to
come back, reloads the latest synced weights into it (the pool keeps the ObjectRefs of
the last sync's buckets, see ``keep_weights_for_restart``), and retries the request
once; a second failure, an engine that does not come back, or an exception raised by the
engine code itself raises :class:`RolloutEngineError` naming the engine and the request.

Weights. :meth:`RolloutPool.sync` is the one weight-sync path (the trainer and the
tests drive it alike): it takes the buckets of a whole model (``weight_buckets``), puts
each in the object store once (or takes the ObjectRef a producer already put), has every
engine load it, and keeps at most ``max_inflight_buckets`` loading at a time. Every
completion carries the ``weight_version`` of the engine weights that produced it.

Placement (which node, how many CPUs/GPUs per engine) comes from
:mod:`megatron_rl.placement`; the pool only applies it.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from megatron_rl.config.rollout import RolloutConfig
from megatron_rl.placement import GroupPlacement
from megatron_rl.rollout.base import (
    Completion,
    SamplingParams,
    check_prompts,
    prompt_seeds_for,
)
from megatron_rl.rollout.worker import EngineWorker
from megatron_rl.weight_buckets import WeightBucket

__all__ = ["RolloutEngineError", "RolloutPool"]

logger = logging.getLogger(__name__)


class RolloutEngineError(RuntimeError):
    """A rollout request or engine operation failed for good (the message names both)."""


@dataclass
class _Request:
    """One slice of a ``generate`` call: prompts ``[lo, hi)``."""

    index: int
    lo: int
    hi: int
    work: int
    num_requests: int
    attempts: int = 0
    engine: int = -1
    timed_out: bool = False

    def describe(self, num_prompts: int) -> str:
        return f"request {self.index}/{self.num_requests} (prompts {self.lo}..{self.hi - 1} of {num_prompts})"


def _actor_errors() -> tuple[type[BaseException], ...]:
    import ray.exceptions as rex

    return (rex.RayActorError, rex.WorkerCrashedError)



class RolloutPool:
    """``rollout.num_engines`` engines of ``rollout.engine`` as Ray actors; ``ray.init`` must have run.

    Args:
        config: the ``rollout`` section (engine kind and arguments, engine count,
            dispatch and recovery settings in ``config.pool``).
        model_path: HF model directory every engine loads (the initial weights, version 0).
        placement: where each engine runs (:mod:`megatron_rl.placement`); default: one
            Ray CPU per engine, Ray's own scheduling.
        name_prefix: engines are named ``{name_prefix}-{index}`` in completions, logs and errors.
    """

    def __init__(
        self,
        config: RolloutConfig,
        model_path: str,
        *,
        placement: GroupPlacement | None = None,
        name_prefix: str = "rollout",
    ):
        import ray

        if not ray.is_initialized():
            raise RuntimeError("RolloutPool needs a Ray cluster: call ray.init(...) first")
        self.config = config
        self.model_path = str(model_path)
        placement = placement or GroupPlacement.uniform(config.num_engines, num_cpus=1.0)
        if len(placement) != config.num_engines:
            raise ValueError(f"placement has {len(placement)} members for {config.num_engines} engines")
        self.engine_names = [f"{name_prefix}-{i}" for i in range(config.num_engines)]
        self.actors = [
            ray.remote(EngineWorker)
            .options(max_restarts=config.pool.max_restarts, max_task_retries=0, **options)
            .remote(config.engine, self.model_path, dict(config.engine_args), name, placement.torch_threads)
            for name, options in zip(self.engine_names, placement.ray_options)
        ]
        self._dead: dict[int, str] = {}
        self._version = 0
        self._sleeping = False
        self._restore_refs: list[ray.ObjectRef] = []
        self.last_stats: dict[str, float] = {}
        # Wait for every engine to load: a bad model path fails here, naming the engine.
        for i, actor in enumerate(self.actors):
            try:
                ray.get(actor.health.remote(), timeout=config.pool.restart_timeout_s)
            except Exception as exc:
                self.shutdown()
                raise RolloutEngineError(f"{self.engine_names[i]} failed to start: {exc}") from exc

    # ------------------------------------------------------------------ properties

    @property
    def num_engines(self) -> int:
        """Engines in the pool (dead ones included)."""
        return len(self.actors)

    @property
    def live_engines(self) -> list[int]:
        """Indices of engines not given up on."""
        return [i for i in range(self.num_engines) if i not in self._dead]

    @property
    def weight_version(self) -> int:
        """Version of the last completed weight sync (0 = initial checkpoint)."""
        return self._version

    # ------------------------------------------------------------------ generation

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        """Sample ``params.n`` completions per prompt on the pool's engines.

        Args:
            prompts: ``P`` prompts of token ids.
            params: sampling settings; ``params.seed`` makes the call reproducible whatever
                the number of engines or the request split.

        Returns:
            ``P`` lists in prompt order, each with the prompt's ``n`` completions.

        Raises:
            RolloutEngineError: a request failed twice, or its engine raised, or no engine
                is left; the message names the engine and the request.
        """
        import ray

        start = time.perf_counter()
        num_prompts = len(prompts)
        if num_prompts == 0:
            return []
        check_prompts(prompts)
        prompts = [list(map(int, p)) for p in prompts]
        seeds = prompt_seeds_for(params.seed, range(num_prompts))
        requests = self._split(prompts, params)
        pending = collections.deque(requests)
        inflight: dict[ray.ObjectRef, _Request] = {}
        outstanding = [0] * self.num_engines
        queued = [0] * self.num_engines
        progress_at = [0.0] * self.num_engines  # last submit-to-idle or completion, per engine
        results: list[list[Completion] | None] = [None] * num_prompts
        retries = 0
        timeout = self.config.pool.request_timeout_s

        while pending or inflight:
            while pending:
                engine = self._pick_engine(outstanding, queued)
                if engine is None:
                    break
                req = pending.popleft()
                req.engine = engine
                if queued[engine] == 0:
                    progress_at[engine] = time.monotonic()
                ref = self.actors[engine].generate.remote(prompts[req.lo : req.hi], params, seeds[req.lo : req.hi])
                inflight[ref] = req
                outstanding[engine] += req.work
                queued[engine] += 1
            if not inflight:
                raise RolloutEngineError(f"no live rollout engine is left to serve {pending[0].describe(num_prompts)}")
            ready, _ = ray.wait(list(inflight), num_returns=1, timeout=self._wait_timeout(inflight, progress_at))
            if not ready:
                self._kill_hung(inflight, progress_at)
                continue
            ref = ready[0]
            req = inflight.pop(ref)
            outstanding[req.engine] -= req.work
            queued[req.engine] -= 1
            progress_at[req.engine] = time.monotonic()
            try:
                out = ray.get(ref)
            except _actor_errors() as exc:
                cause = f"timed out after {timeout}s" if req.timed_out else f"engine died ({exc})"
                retries += 1
                self._before_retry(req, cause, exc, num_prompts)
                pending.appendleft(req)
                continue
            except ray.exceptions.RayTaskError as exc:
                raise RolloutEngineError(
                    f"{self.engine_names[req.engine]} raised on {req.describe(num_prompts)}: {exc}"
                ) from exc
            if len(out) != req.hi - req.lo:
                raise RolloutEngineError(
                    f"{self.engine_names[req.engine]} returned {len(out)} groups for {req.describe(num_prompts)}"
                )
            stale = {c.weight_version for group in out for c in group} - {self._version}
            if stale:
                # The engine restarted between calls (reloading the initial checkpoint) and
                # served old weights: restore the current ones and redo the request.
                retries += 1
                cause = f"served weight version {sorted(stale)} instead of {self._version} (restarted?)"
                self._before_retry(req, cause, None, num_prompts)
                pending.appendleft(req)
                continue
            results[req.lo : req.hi] = out

        self.last_stats = {
            "timing_s/generate": time.perf_counter() - start,
            "rollout/num_requests": float(len(requests)),
            "rollout/num_retries": float(retries),
            "rollout/num_generated_tokens": float(sum(len(c) for group in results for c in group)),
        }
        return results  # type: ignore[return-value]

    def _split(self, prompts: list[list[int]], params: SamplingParams) -> list[_Request]:
        """Contiguous prompt ranges; a prompt's n samples always stay in one request."""
        live = max(1, len(self.live_engines))
        size = self.config.pool.max_prompts_per_request or math.ceil(len(prompts) / live)
        bounds = [(lo, min(lo + size, len(prompts))) for lo in range(0, len(prompts), size)]
        return [
            _Request(
                index=i,
                lo=lo,
                hi=hi,
                work=sum(len(p) + params.n * params.max_new_tokens for p in prompts[lo:hi]),
                num_requests=len(bounds),
            )
            for i, (lo, hi) in enumerate(bounds)
        ]

    def _pick_engine(self, outstanding: list[int], queued: list[int]) -> int | None:
        """The live engine with the least outstanding work that has room for a request."""
        cap = self.config.pool.max_inflight_requests_per_engine
        candidates = [i for i in self.live_engines if queued[i] < cap]
        if not candidates:
            return None
        return min(candidates, key=lambda i: (outstanding[i], queued[i], i))

    def _busy_engines(self, inflight: dict[Any, _Request]) -> set[int]:
        """Engines with work in flight that have not already been killed for a time-out."""
        timed_out = {req.engine for req in inflight.values() if req.timed_out}
        return {req.engine for req in inflight.values()} - timed_out

    def _wait_timeout(self, inflight: dict[Any, _Request], progress_at: list[float]) -> float | None:
        """Seconds until a busy engine would exceed ``request_timeout_s`` without progress."""
        limit = self.config.pool.request_timeout_s
        busy = self._busy_engines(inflight)
        if limit is None or not busy:
            return None  # requests of killed engines fail as soon as the kill lands
        return max(0.0, min(progress_at[e] for e in busy) + limit - time.monotonic())

    def _kill_hung(self, inflight: dict[Any, _Request], progress_at: list[float]) -> None:
        """Kill (so Ray restarts) engines that finished nothing for ``request_timeout_s``.

        The clock of an engine runs from when it got work while idle, or from its last
        completed request, so a request queued behind another is not charged its wait.
        """
        import ray

        limit = self.config.pool.request_timeout_s
        now = time.monotonic()
        for engine in sorted(self._busy_engines(inflight)):
            if limit is not None and now - progress_at[engine] >= limit:
                logger.warning(
                    "%s: no request finished in request_timeout_s=%.1f; restarting the engine",
                    self.engine_names[engine], limit,
                )  # fmt: skip
                for req in inflight.values():  # every request queued on it dies with it
                    if req.engine == engine:
                        req.timed_out = True
                ray.kill(self.actors[engine], no_restart=False)

    def _before_retry(self, req: _Request, cause: str, exc: BaseException | None, num_prompts: int) -> None:
        """Bring the failed request's engine back (or give it up) before one retry."""
        name = self.engine_names[req.engine]
        req.attempts += 1
        req.timed_out = False
        if req.attempts > 1:
            raise RolloutEngineError(f"{name} failed {req.describe(num_prompts)} again after a retry: {cause}") from exc
        logger.warning("%s: %s on %s; retrying once", name, cause, req.describe(num_prompts))
        if req.engine not in self._dead:
            try:
                self._recover(req.engine)
            except RolloutEngineError as rec_exc:
                self._dead[req.engine] = str(rec_exc)
                logger.error("%s", rec_exc)
        if not self.live_engines:
            raise RolloutEngineError(
                f"{name} failed {req.describe(num_prompts)} ({cause}) and no live engine is left: "
                + "; ".join(self._dead.values())
            ) from exc

    def _recover(self, engine: int) -> None:
        """Wait until a restarted engine answers, then restore the pool's weights and state."""
        import ray

        name, actor = self.engine_names[engine], self.actors[engine]
        deadline = time.monotonic() + self.config.pool.restart_timeout_s
        health = None
        died = 0
        while time.monotonic() < deadline:
            try:
                health = ray.get(actor.health.remote(), timeout=max(1.0, deadline - time.monotonic()))
                break
            except ray.exceptions.ActorDiedError as exc:
                # Unavailable = restarting; Died on a fresh call = out of restarts (checked a
                # few times: the error of a call racing the restart can also read "died").
                died += 1
                if died >= 3:
                    raise RolloutEngineError(f"{name} is dead and will not restart: {exc}") from exc
                time.sleep(0.5)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                time.sleep(0.2)
        if health is None:
            raise RolloutEngineError(
                f"{name} did not come back within restart_timeout_s={self.config.pool.restart_timeout_s}"
            )
        if health["weight_version"] != self._version:
            if not self._restore_refs:
                raise RolloutEngineError(
                    f"{name} restarted with weight version {health['weight_version']} but the pool is at "
                    f"version {self._version} and keeps no weights to restore (keep_weights_for_restart=False)"
                )
        try:
            if health["weight_version"] != self._version:
                ray.get([actor.load_bucket.remote(ref, self._version) for ref in self._restore_refs])
                logger.info("%s: restored weight version %d after a restart", name, self._version)
            if self._sleeping:
                ray.get(actor.sleep.remote())
        except ray.exceptions.RayError as exc:
            raise RolloutEngineError(f"{name} failed while restoring its state after a restart: {exc}") from exc

    # ------------------------------------------------------------------ weights

    def sync(self, buckets: Iterable[WeightBucket | Any], *, version: int) -> dict[str, float]:
        """Load a whole model's weights into every live engine; they then report ``version``.

        Args:
            buckets: the model's :class:`~megatron_rl.weight_buckets.WeightBucket` s, or
                ObjectRefs of buckets a producer already put (the actor's rank 0 does);
                consumed once, lazily, so a producer runs at most one bucket ahead of the
                ``rollout.pool.max_inflight_buckets`` being loaded. Each sync must carry
                the whole model: its buckets are what a restarted engine gets back.
            version: the weight version the engines report afterwards (and tag
                completions with).

        An engine that dies during the sync is restarted and reloaded at the end; an
        engine that raises while loading makes the sync raise :class:`RolloutEngineError`
        naming it (engines may then hold a mix of versions until the next full sync).

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
        # The previous sync's buckets are no longer what a restarted engine should get
        # (this sync's are, at the end); dropping them now keeps one model copy at most.
        self._restore_refs = []
        failed: set[int] = set()
        put_seconds = 0.0
        sizes: list[tuple[int, int]] = []  # per bucket: (tensors, bytes)
        refs: list[ray.ObjectRef] = []
        inflight: list[tuple[int, list[tuple[int, ray.ObjectRef]]]] = []  # (bucket, [(engine, load ref)])
        try:
            for bucket in buckets:
                while len(inflight) >= self.config.pool.max_inflight_buckets:
                    self._wait_loads(*inflight.pop(0), sizes, failed)
                t0 = time.perf_counter()
                if isinstance(bucket, WeightBucket):
                    sizes.append((len(bucket.entries), bucket.num_bytes))
                    ref = ray.put(bucket)
                else:  # already in the object store; its size is known once an engine loaded it
                    sizes.append((0, 0))
                    ref = bucket
                del bucket  # the object store holds the only copy from here on
                put_seconds += time.perf_counter() - t0
                targets = [i for i in self.live_engines if i not in failed]
                inflight.append((len(refs), [(i, self.actors[i].load_bucket.remote(ref, version)) for i in targets]))
                refs.append(ref)
            for index, loads in inflight:
                self._wait_loads(index, loads, sizes, failed)
        except BaseException:
            logger.error("weight sync aborted; engines may hold partially updated weights until the next sync")
            raise
        self._finish_sync(version, refs, failed)
        num_tensors, num_bytes = sum(t for t, _ in sizes), sum(b for _, b in sizes)
        seconds = time.perf_counter() - start
        stats = {
            "weight_sync/seconds": seconds,
            "weight_sync/put_seconds": put_seconds,
            "weight_sync/bytes": float(num_bytes),
            "weight_sync/num_tensors": float(num_tensors),
            "weight_sync/num_buckets": float(len(refs)),
            "weight_sync/num_engines": float(self.num_engines),
            "weight_sync/gib_per_s": num_bytes / seconds / (1 << 30) if seconds > 0 else float("inf"),
            "weight_sync/version": float(version),
        }
        logger.info(
            "weight sync v%d: %.3f GiB in %d buckets to %d engines in %.2fs",
            version, num_bytes / (1 << 30), len(refs), self.num_engines, seconds,
        )  # fmt: skip
        return stats

    def _wait_loads(
        self, index: int, loads: list[tuple[int, Any]], sizes: list[tuple[int, int]], failed: set[int]
    ) -> None:
        """Wait for the loads of bucket ``index``; an engine that died mid-sync is reloaded at the end."""
        import ray

        for engine, ref in loads:
            try:
                loaded = ray.get(ref)
            except _actor_errors() as exc:
                logger.warning(
                    "%s died during a weight sync (%s); it is reloaded at the end", self.engine_names[engine], exc
                )
                failed.add(engine)
                continue
            except ray.exceptions.RayTaskError as exc:
                raise RolloutEngineError(f"{self.engine_names[engine]} failed to load weights: {exc}") from exc
            if sizes[index] == (0, 0):
                sizes[index] = (int(loaded["num_tensors"]), int(loaded["num_bytes"]))

    def _finish_sync(self, version: int, refs: list[Any], failed: set[int]) -> None:
        """Record the new version; reload engines that died during the sync."""
        self._version = int(version)
        self._restore_refs = list(refs)
        for engine in sorted(failed):
            try:
                self._recover(engine)
            except RolloutEngineError as exc:
                self._dead[engine] = str(exc)
                logger.error("%s", exc)
        if not self.config.pool.keep_weights_for_restart:
            self._restore_refs = []
        if not self.live_engines:
            raise RolloutEngineError(
                "every rollout engine died during the weight sync: " + "; ".join(self._dead.values())
            )

    # ------------------------------------------------------------------ lifecycle

    def _call_all(self, method: str) -> list[Any]:
        import ray

        refs = {i: getattr(self.actors[i], method).remote() for i in self.live_engines}
        out = []
        for i, ref in refs.items():
            try:
                out.append(ray.get(ref, timeout=self.config.pool.restart_timeout_s))
            except Exception as exc:
                raise RolloutEngineError(f"{self.engine_names[i]}.{method}() failed: {exc}") from exc
        return out

    def sleep(self) -> None:
        """Release every engine's accelerator memory (colocated placement)."""
        self._call_all("sleep")
        self._sleeping = True

    def wake(self) -> None:
        """Restore every engine's accelerator memory."""
        self._call_all("wake")
        self._sleeping = False

    def health(self) -> list[dict[str, Any]]:
        """One report per engine; a dead or unresponsive engine reports ``ok: False``."""
        import ray

        reports = []
        for i, actor in enumerate(self.actors):
            if i in self._dead:
                reports.append({"ok": False, "engine": self.engine_names[i], "error": self._dead[i]})
                continue
            try:
                reports.append(ray.get(actor.health.remote(), timeout=self.config.pool.restart_timeout_s))
            except Exception as exc:
                reports.append({"ok": False, "engine": self.engine_names[i], "error": f"{type(exc).__name__}: {exc}"})
        return reports

    def node_ids(self) -> list[str | None]:
        """The Ray node id of every engine (``None`` for a dead one), in engine order."""
        import ray

        refs = {i: self.actors[i].node_id.remote() for i in self.live_engines}
        timeout = self.config.pool.restart_timeout_s
        return [ray.get(refs[i], timeout=timeout) if i in refs else None for i in range(self.num_engines)]

    def __enter__(self) -> RolloutPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Kill every engine actor (no restart) and drop the kept weight buckets."""
        import ray

        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already gone
                pass
        self._restore_refs = []
