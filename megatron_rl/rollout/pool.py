"""A pool of rollout engines running as Ray actors, with dispatch, retries and weight sync.

``RolloutPool.generate(prompts, params)`` splits the prompts into requests (contiguous
prompt ranges, the ``n`` samples of a prompt always in the same request), sends each to
the live engine with the least outstanding work (estimated tokens: prompt tokens plus
``n * max_new_tokens`` per prompt, at most ``max_inflight_requests_per_engine`` requests
queued per engine so a faster engine takes more of them), and returns the completions in
prompt order. Prompt seeds are derived from a prompt's position in the whole call, so
results do not depend on which engine served which prompt.

Failures. Engines are Ray actors with ``max_restarts`` (Ray re-runs the constructor,
which reloads the *initial* checkpoint) and ``max_task_retries=0``: the pool, not Ray,
decides what to retry, because a restarted engine must first get the current weights
back. When a request fails because its engine died (or exceeded ``request_timeout_s``,
in which case the pool kills it so Ray restarts it), the pool waits for the engine to
come back, reloads the latest synced weights into it (the pool keeps the ObjectRefs of
the last sync's buckets, see ``keep_weights_for_restart``), and retries the request
once; a second failure, an engine that does not come back, or an exception raised by the
engine code itself raises :class:`RolloutEngineError` naming the engine and the request.

Weights. ``update_weights`` streams HF-named tensors to every engine through the object
store (``weight_sync.py``); every completion carries the ``weight_version`` of the
engine weights that produced it.
"""

from __future__ import annotations

import collections
import importlib
import logging
import math
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from megatron_rl.rollout.base import Completion, RolloutEngine, SamplingParams, check_prompts, prompt_seeds_for

if TYPE_CHECKING:
    import ray

    from megatron_rl.config import RolloutConfig
    from megatron_rl.rollout.weight_sync import WeightBucket

__all__ = [
    "EngineSpec", "EngineWorker", "PoolOptions", "RolloutEngineError", "RolloutPool", "build_engine",
    "scheduling_strategies",
]  # fmt: skip

logger = logging.getLogger(__name__)

_BUILTIN_ENGINES = {
    "hf": ("megatron_rl.rollout.hf_engine", "HFEngine"),
    "vllm": ("megatron_rl.rollout.vllm_engine", "VLLMEngine"),
}


class RolloutEngineError(RuntimeError):
    """A rollout request or engine operation failed for good (the message names both)."""


@dataclass(kw_only=True)
class EngineSpec:
    """What each engine of a pool is: its backend, its weights and its backend arguments."""

    kind: str = "hf"
    """``hf``, ``vllm``, or ``package.module:Class`` for a user :class:`RolloutEngine`
    subclass (constructed as ``Class(model_path, name=..., **engine_args)``)."""

    model_path: str
    """HF model directory loaded by every engine (the initial weights, version 0)."""

    engine_args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments handed to the engine unchanged (``rollout.engine_args``)."""

    def __post_init__(self) -> None:
        if self.kind not in _BUILTIN_ENGINES:
            module, sep, cls = self.kind.partition(":")
            if not sep or not module or not cls:
                raise ValueError(
                    f"EngineSpec.kind: got {self.kind!r}; use 'hf', 'vllm' or 'package.module:Class'"
                )


def build_engine(spec: EngineSpec, *, name: str) -> RolloutEngine:
    """Construct the engine ``spec`` describes (imports the backend lazily)."""
    module_name, cls_name = _BUILTIN_ENGINES.get(spec.kind) or spec.kind.split(":", 1)
    cls = getattr(importlib.import_module(module_name), cls_name)
    if not (isinstance(cls, type) and issubclass(cls, RolloutEngine)):
        raise TypeError(f"engine kind {spec.kind!r} is not a RolloutEngine subclass")
    return cls(spec.model_path, name=name, **spec.engine_args)


@dataclass(kw_only=True)
class PoolOptions:
    """How the pool places, feeds and recovers its engines (not in ``RolloutConfig``)."""

    num_cpus_per_engine: float = 1.0
    """Ray CPUs reserved per engine actor; a CPU engine also uses this many torch threads."""

    num_gpus_per_engine: float = 0.0
    """Ray GPUs per engine actor (vLLM: the tensor-parallel size; fractions for colocated
    placement on a GPU shared with the actor)."""

    scheduling_strategy: str = "DEFAULT"
    """Where Ray puts the engines: ``DEFAULT`` (Ray's own choice) or ``SPREAD``
    (contiguous blocks over the alive nodes, see :func:`scheduling_strategies`)."""

    max_restarts: int = 3
    """Times Ray restarts a dead engine actor (-1: unlimited)."""

    restart_timeout_s: float = 300.0
    """How long to wait for a restarted engine to answer before giving up on it."""

    request_timeout_s: float | None = None
    """An engine with work that finishes no request for this long is treated as hung: it
    is killed (Ray restarts it) and its requests are retried; null waits forever."""

    max_prompts_per_request: int | None = None
    """Prompts per request; null splits a call evenly into one request per live engine."""

    max_inflight_requests_per_engine: int = 2
    """Requests queued on one engine at a time (2 keeps it busy between requests)."""

    keep_weights_for_restart: bool = True
    """Keep the last sync's buckets in the object store (one model copy) so a restarted
    engine gets the current weights back; false saves that memory, and a restart after
    the first sync becomes an error."""

    name_prefix: str = "rollout"
    """Engines are named ``{name_prefix}-{index}`` in completions, logs and errors."""

    def __post_init__(self) -> None:
        if self.num_cpus_per_engine < 0 or self.num_gpus_per_engine < 0:
            raise ValueError("PoolOptions: num_cpus_per_engine and num_gpus_per_engine must be >= 0")
        if self.max_restarts < -1:
            raise ValueError(f"PoolOptions.max_restarts: got {self.max_restarts}; must be >= -1")
        if self.max_prompts_per_request is not None and self.max_prompts_per_request < 1:
            raise ValueError(f"PoolOptions.max_prompts_per_request: got {self.max_prompts_per_request}; must be >= 1")
        if self.max_inflight_requests_per_engine < 1:
            raise ValueError("PoolOptions.max_inflight_requests_per_engine must be >= 1")


def scheduling_strategies(strategy: str, count: int, *, num_cpus: float = 0.0, num_gpus: float = 0.0) -> list[Any]:
    """One Ray scheduling strategy for each of ``count`` actors (``ray.init`` must have run).

    ``SPREAD`` is deterministic here: actor ``i`` is pinned to node ``i * n // count`` of
    the ``n`` alive nodes, ordered by IP then node id. Contiguous blocks keep neighbouring
    actors (the ranks of one TP group) on one node, and with ``count >= n`` every node
    gets work. The pin is hard (Ray's node affinity with ``soft=False``): Ray's own
    ``SPREAD`` and soft affinity are best effort, and in our tests both put actors that
    reserve no resources on one node. A block that needs more CPUs or GPUs than its node
    has raises ``ValueError`` (it would wait forever). Any other value (``DEFAULT``, a Ray
    strategy object) is used for every actor unchanged.
    """
    if strategy != "SPREAD":
        return [strategy] * count
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = sorted((n for n in ray.nodes() if n["Alive"]), key=lambda n: (n["NodeManagerAddress"], n["NodeID"]))
    placement = [nodes[i * len(nodes) // count] for i in range(count)]
    for node in nodes:
        block = sum(1 for chosen in placement if chosen is node)
        have = node["Resources"]
        if block * num_cpus > have.get("CPU", 0) or block * num_gpus > have.get("GPU", 0):
            raise ValueError(
                f"SPREAD placement: node {node['NodeManagerAddress']} ({node['NodeID'][:8]}) would get {block} "
                f"actor(s) needing {num_cpus:g} CPU and {num_gpus:g} GPU each, but has "
                f"{have.get('CPU', 0):g} CPU and {have.get('GPU', 0):g} GPU"
            )
    return [NodeAffinitySchedulingStrategy(node["NodeID"], soft=False) for node in placement]


class EngineWorker:
    """The body of one engine's Ray actor: builds the engine and forwards calls to it."""

    def __init__(self, spec: EngineSpec, name: str, num_threads: int):
        # Before the engine imports anything heavy: one process per engine, so the torch
        # thread count is this actor's CPU share, not the whole machine.
        torch.set_num_threads(max(1, num_threads))
        self.engine = build_engine(spec, name=name)

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
    """``num_engines`` engines of ``spec`` as Ray actors; ``ray.init`` must have run.

    Args:
        spec: backend, model directory and engine arguments shared by every engine.
        num_engines: engine replicas.
        options: placement, dispatch and recovery settings.
    """

    def __init__(self, spec: EngineSpec, *, num_engines: int, options: PoolOptions | None = None):
        import ray

        if not ray.is_initialized():
            raise RuntimeError("RolloutPool needs a Ray cluster: call ray.init(...) first")
        if num_engines < 1:
            raise ValueError(f"num_engines: got {num_engines}; must be >= 1")
        self.spec = spec
        self.options = options or PoolOptions()
        opts = self.options
        self.engine_names = [f"{opts.name_prefix}-{i}" for i in range(num_engines)]
        placement = scheduling_strategies(
            opts.scheduling_strategy, num_engines, num_cpus=opts.num_cpus_per_engine, num_gpus=opts.num_gpus_per_engine
        )
        threads = max(1, int(opts.num_cpus_per_engine))
        self.actors = [
            ray.remote(EngineWorker)
            .options(
                num_cpus=opts.num_cpus_per_engine,
                num_gpus=opts.num_gpus_per_engine,
                max_restarts=opts.max_restarts,
                max_task_retries=0,
                scheduling_strategy=strategy,
            )
            .remote(spec, name, threads)
            for name, strategy in zip(self.engine_names, placement)
        ]
        self._dead: dict[int, str] = {}
        self._version = 0
        self._sleeping = False
        self._restore_refs: list[ray.ObjectRef] = []
        self._sync_failed: set[int] = set()
        self.last_stats: dict[str, float] = {}
        # Wait for every engine to load: a bad model path fails here, naming the engine.
        for i, actor in enumerate(self.actors):
            try:
                ray.get(actor.health.remote(), timeout=opts.restart_timeout_s)
            except Exception as exc:
                self.shutdown()
                raise RolloutEngineError(f"{self.engine_names[i]} failed to start: {exc}") from exc

    @classmethod
    def from_config(
        cls, rollout: RolloutConfig, model_path: str, *, options: PoolOptions | None = None
    ) -> RolloutPool:
        """A pool of ``rollout.num_engines`` engines of ``rollout.engine`` over ``model_path``."""
        spec = EngineSpec(kind=rollout.engine, model_path=str(model_path), engine_args=dict(rollout.engine_args))
        return cls(spec, num_engines=rollout.num_engines, options=options)

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
        timeout = self.options.request_timeout_s

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
        size = self.options.max_prompts_per_request or math.ceil(len(prompts) / live)
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
        cap = self.options.max_inflight_requests_per_engine
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
        limit = self.options.request_timeout_s
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

        limit = self.options.request_timeout_s
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
        deadline = time.monotonic() + self.options.restart_timeout_s
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
                f"{name} did not come back within restart_timeout_s={self.options.restart_timeout_s}"
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

    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int,
        *,
        bucket_mb: float = 512,
    ) -> dict[str, Any]:
        """Load HF-named full tensors into every engine (see ``weight_sync.sync_weights``).

        Each sync must carry the whole model: its buckets are what a restarted engine
        gets back. Returns the sync stats (seconds, bytes, buckets, GiB/s, version).
        """
        from megatron_rl.rollout.weight_sync import sync_weights

        return sync_weights(self, named_tensors, version=version, bucket_mb=bucket_mb)

    def begin_weight_update(self, version: int) -> None:
        """Start a sync to ``version`` (called by ``weight_sync.sync_weights``)."""
        if version < self._version:
            logger.warning("weight sync to version %d is older than the pool's %d", version, self._version)
        self._sync_failed = set()
        # The previous sync's buckets are no longer what a restarted engine should get
        # (this sync's are, at the end); dropping them now keeps one model copy at most.
        self._restore_refs = []

    def load_bucket_everywhere(self, ref: ray.ObjectRef, version: int) -> list[tuple[int, ray.ObjectRef]]:
        """Ask every live engine to load bucket ``ref``; returns ``(engine, load ref)`` pairs."""
        return [
            (i, self.actors[i].load_bucket.remote(ref, version))
            for i in self.live_engines
            if i not in self._sync_failed
        ]

    def wait_weight_loads(self, loads: list[tuple[int, ray.ObjectRef]]) -> None:
        """Wait for bucket loads; an engine that died mid-sync gets a full reload at the end."""
        import ray

        for engine, ref in loads:
            try:
                ray.get(ref)
            except _actor_errors() as exc:
                logger.warning(
                    "%s died during a weight sync (%s); it is reloaded at the end", self.engine_names[engine], exc
                )
                self._sync_failed.add(engine)
            except ray.exceptions.RayTaskError as exc:
                raise RolloutEngineError(f"{self.engine_names[engine]} failed to load weights: {exc}") from exc

    def finish_weight_update(self, version: int, bucket_refs: list[ray.ObjectRef]) -> None:
        """Complete a sync: reload engines that died during it, record the new version."""
        self._version = int(version)
        self._restore_refs = list(bucket_refs)
        for engine in sorted(self._sync_failed):
            try:
                self._recover(engine)
            except RolloutEngineError as exc:
                self._dead[engine] = str(exc)
                logger.error("%s", exc)
        self._sync_failed = set()
        if not self.options.keep_weights_for_restart:
            self._restore_refs = []
        if not self.live_engines:
            raise RolloutEngineError(
                "every rollout engine died during the weight sync: " + "; ".join(self._dead.values())
            )

    def abort_weight_update(self) -> None:
        """A sync raised: engines may hold a mix of versions until the next full sync."""
        logger.error("weight sync aborted; engines may hold partially updated weights until the next sync")
        self._sync_failed = set()

    # ------------------------------------------------------------------ lifecycle

    def _call_all(self, method: str) -> list[Any]:
        import ray

        refs = {i: getattr(self.actors[i], method).remote() for i in self.live_engines}
        out = []
        for i, ref in refs.items():
            try:
                out.append(ray.get(ref, timeout=self.options.restart_timeout_s))
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
                reports.append(ray.get(actor.health.remote(), timeout=self.options.restart_timeout_s))
            except Exception as exc:
                reports.append({"ok": False, "engine": self.engine_names[i], "error": f"{type(exc).__name__}: {exc}"})
        return reports

    def node_ids(self) -> list[str | None]:
        """The Ray node id of every engine (``None`` for a dead one), in engine order."""
        import ray

        refs = {i: self.actors[i].node_id.remote() for i in self.live_engines}
        timeout = self.options.restart_timeout_s
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
