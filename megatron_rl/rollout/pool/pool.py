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
come back, brings it to the pool's weight version (:attr:`RolloutPool.restorer`, or
the buckets of the last object-store sync, see ``keep_weights_for_restart``), and
retries the request once; a second failure, an engine that does not come back, or an
exception raised by the engine code itself raises :class:`RolloutEngineError` naming
the engine and the request.

Weights: :class:`~megatron_rl.rollout.pool.weights.PoolWeights` (a version into every live
engine, and the restore of a restarted one), which the pool inherits. Every completion
carries the ``weight_version`` of the engine weights that produced it.

Placement (which node, how many CPUs/GPUs per engine) comes from
:mod:`megatron_rl.cluster.placement`; the pool only applies it.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from megatron_rl.cluster.placement import GroupPlacement
from megatron_rl.config.rollout import RolloutConfig
from megatron_rl.rollout.generation import Completion, SamplingParams
from megatron_rl.rollout.pool.dispatch import Request, hung_engines, pick_engine, plan_call, wait_timeout
from megatron_rl.rollout.pool.recovery import RolloutEngineError, actor_errors, wait_until_back
from megatron_rl.rollout.pool.weights import PoolWeights
from megatron_rl.rollout.pool.worker import EngineWorker
from megatron_rl.weight_sync.client import TransferFailedError
from megatron_rl.weight_sync.meta import TensorMeta

__all__ = ["RolloutEngineError", "RolloutPool", "stop_engines"]

logger = logging.getLogger(__name__)


class RolloutPool(PoolWeights):
    """``rollout.num_engines`` engines of ``rollout.engine`` as Ray actors; ``ray.init`` must have run.

    Args:
        config: the ``rollout`` section (engine kind and arguments, engine count,
            dispatch and recovery settings in ``config.pool``).
        model_path: HF model directory every engine loads (the initial weights, version 0).
        placement: where each engine runs (:mod:`megatron_rl.cluster.placement`); default: one
            Ray CPU per engine, Ray's own scheduling.
        name_prefix: engines are named ``{name_prefix}-{index}`` in completions, logs and errors.
        weight_backend: how the engines receive weights (``object_store``, or the transfer
            backend of ``rollout.weight_transport``: ``gloo``, ``nccl``, ``ipc``).
        weight_format: the updates' wire format (``rollout.weight_dtype``: ``auto``, ``fp8``).
        lora_rank: engines load the actor's LoRA adapters of this rank at every version
            (``rollout.lora_sync: adapter``; :meth:`load_adapter`); None: merged weights.
        workers: engine actors an earlier pool started with these same arguments and
            placement (``loop.warm``), to build their engines again instead of starting
            new processes (``EngineWorker.reset``); a Ray restart then runs the same
            constructor as for new ones.
    """

    def __init__(
        self,
        config: RolloutConfig,
        model_path: str,
        *,
        placement: GroupPlacement | None = None,
        name_prefix: str = "rollout",
        weight_backend: str = "object_store",
        weight_format: str = "auto",
        lora_rank: int | None = None,
        workers: list[Any] | None = None,
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
        self.actors = workers or [
            ray.remote(EngineWorker)
            .options(max_restarts=config.pool.max_restarts, max_task_retries=0, **options)
            .remote(config.engine, self.model_path, dict(config.engine_args), name, placement.torch_threads,
                    weight_backend, placement.devices_of(i), weight_format, config.tensor_parallel_size,
                    config.routing_replay, lora_rank)  # fmt: skip
            for i, (name, options) in enumerate(zip(self.engine_names, placement.ray_options))
        ]
        self.weight_backend = weight_backend
        self._dead: dict[int, str] = {}
        self._version = 0
        self._sleeping = False
        self._restore_refs: list[ray.ObjectRef] = []
        self._restore_metas: list[TensorMeta] = []
        self._adapter: Any = None
        """The ObjectRef of the last adapters loaded (:meth:`load_adapter`): a restored engine
        takes them over its base weights."""
        self.restorer: Callable[[list[int]], None] | None = None
        """Brings the given (restarted) engines to the pool's weight version; set by the
        run's weight sync. Without one, the buckets of the last object-store sync are used."""
        self.restarts = 0
        """Engine restarts seen so far (a transfer group that included a restarted engine
        must be rebuilt)."""
        self.last_stats: dict[str, float] = {}
        self._restarts_seen: dict[int, int] = {}
        """Restarts of each engine seen so far (answers from a new process): whether Ray
        still has one for it (``max_restarts``) when a call to it reads "died"."""
        self._pids: dict[int, int] = {}
        """The last process id each engine answered from (what :meth:`restart` kills when the
        engine does not answer in time to name it)."""
        if workers is not None and len(workers) != config.num_engines:
            raise ValueError(f"{len(workers)} engine workers for {config.num_engines} engines")
        # Wait for every engine to load: a bad model path fails here, naming the engine.
        ready = [actor.reset.remote() if workers else actor.health.remote() for actor in self.actors]
        for i, report in enumerate(ready):
            try:
                self._pids[i] = ray.get(report, timeout=config.pool.restart_timeout_s)["pid"]
            except Exception as exc:
                # Shut down the engines that are up; one still loading cannot answer, so it
                # is killed without waiting for that.
                up, _ = ray.wait(ready, num_returns=len(ready), timeout=0)
                stop_engines(self.actors, live=[j for j, ref in enumerate(ready) if ref in up and j != i])
                # A timeout names its setting: a large model's first load (or a busy machine)
                # can outlast the default, and raising it is the user's fix.
                timed_out = isinstance(exc, ray.exceptions.GetTimeoutError)
                why = f"not up within rollout.pool.restart_timeout_s={config.pool.restart_timeout_s:g}" if timed_out else exc
                raise RolloutEngineError(f"{self.engine_names[i]} failed to start: {why}") from exc

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
        prompts, seeds, requests = plan_call(prompts, params, num_live=len(self.live_engines),
                                             max_prompts_per_request=self.config.pool.max_prompts_per_request)  # fmt: skip
        pending = collections.deque(requests)
        inflight: dict[ray.ObjectRef, Request] = {}
        outstanding = [0] * self.num_engines
        queued = [0] * self.num_engines
        progress_at = [0.0] * self.num_engines  # last submit-to-idle or completion, per engine
        results: list[list[Completion] | None] = [None] * num_prompts
        retries = 0
        timeout = self.config.pool.request_timeout_s

        while pending or inflight:
            while pending:
                engine = pick_engine(
                    self.live_engines, outstanding, queued, cap=self.config.pool.max_inflight_requests_per_engine
                )
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
            ready, _ = ray.wait(list(inflight), num_returns=1, timeout=wait_timeout(inflight.values(), progress_at, timeout))
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
            except actor_errors() as exc:
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

    def _kill_hung(self, inflight: dict[Any, Request], progress_at: list[float]) -> None:
        """Kill (so Ray restarts) engines that finished nothing for ``request_timeout_s``."""
        import ray

        limit = self.config.pool.request_timeout_s
        for engine in hung_engines(inflight.values(), progress_at, limit):
            logger.warning("%s: no request finished in request_timeout_s=%.1f; restarting the engine",
                           self.engine_names[engine], limit)  # fmt: skip
            for req in inflight.values():  # every request queued on it dies with it
                if req.engine == engine:
                    req.timed_out = True
            ray.kill(self.actors[engine], no_restart=False)

    def _before_retry(self, req: Request, cause: str, exc: BaseException | None, num_prompts: int) -> None:
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

    def _recover(self, engine: int, *, restore: bool = True, replaces_pid: int | None = None) -> None:
        """Wait until a restarted engine answers (from a process other than ``replaces_pid``),
        then restore the pool's weights (unless ``restore`` is false: a sync is about to
        bring every engine to a new version) and its sleep state."""
        import ray

        name, actor = self.engine_names[engine], self.actors[engine]
        max_restarts = self.config.pool.max_restarts
        health = wait_until_back(
            actor, name, timeout_s=self.config.pool.restart_timeout_s, replaces_pid=replaces_pid,
            may_restart=max_restarts < 0 or self._restarts_seen.get(engine, 0) < max_restarts,
        )  # fmt: skip
        self._saw_pid(engine, health["pid"])
        self.restarts += 1
        try:
            if restore and health["weight_version"] != self._version:
                self._restore([engine])
                logger.info("%s: restored weight version %d after a restart", name, self._version)
            if self._sleeping:
                ray.get(actor.sleep.remote())
        except (ray.exceptions.RayError, TransferFailedError) as exc:
            raise RolloutEngineError(f"{name} failed while restoring its state after a restart: {exc}") from exc

    def _saw_pid(self, engine: int, pid: int) -> None:
        """Record the process ``engine`` answered from; a new one is a restart."""
        if engine in self._pids and self._pids[engine] != pid:
            self._restarts_seen[engine] = self._restarts_seen.get(engine, 0) + 1
        self._pids[engine] = pid

    def _recover_all(
        self, engines: Iterable[int], *, restore: bool = True, killed_pids: dict[int, int] | None = None
    ) -> None:
        """Bring dead-then-restarted ``engines`` back (or give them up, naming why);
        ``killed_pids``: the processes :meth:`restart` killed, by engine."""
        killed_pids = killed_pids or {}
        for engine in sorted(engines):
            try:
                self._recover(engine, restore=restore, replaces_pid=killed_pids.get(engine))
            except RolloutEngineError as exc:
                self._dead[engine] = str(exc)
                logger.error("%s", exc)
        if not self.live_engines:
            raise RolloutEngineError("every rollout engine is dead: " + "; ".join(self._dead.values()))

    def restart(self, engines: Iterable[int], *, restore: bool = True) -> None:
        """Kill ``engines`` (Ray restarts them with the initial weights) and wait for them;
        ``restore``: bring them to the pool's weight version (otherwise they hold version 0
        until the next sync). How an engine left with mixed weights is repaired."""
        import ray

        engines = [e for e in engines if e not in self._dead]
        killed_pids = {}
        for engine in engines:
            # Kill the process that answers (then wait for another pid: the kill is
            # asynchronous) or hangs; one that died already is restarting, and killing it
            # again could kill its successor after that successor had answered.
            try:
                killed_pids[engine] = ray.get(self.actors[engine].health.remote(), timeout=5.0)["pid"]
                # A process the pool has not seen yet is a restart Ray already spent (an
                # engine that died on its own just before, e.g. mid-sync): count it, so the
                # wait below knows whether Ray has a restart left for the kill.
                self._saw_pid(engine, killed_pids[engine])
            except ray.exceptions.RayActorError:
                logger.info("%s is already restarting; waiting for it", self.engine_names[engine])
                continue
            except ray.exceptions.GetTimeoutError:
                # Hung, or slow to answer on a loaded machine: it is still the process it
                # last answered from, so wait for a different one (without a pid the dying
                # process's next answer would count as the engine being back).
                if engine in self._pids:
                    killed_pids[engine] = self._pids[engine]
            ray.kill(self.actors[engine], no_restart=False)
        self._recover_all(engines, restore=restore, killed_pids=killed_pids)

    # ------------------------------------------------------------------ lifecycle

    def _call_all(self, method: str, *, sleeping: bool) -> None:
        """``method`` on every live engine, which then are ``sleeping`` (or not). An engine
        that dies during it is brought back as during generation (restarted by Ray, its
        weights restored, put to sleep if the pool sleeps: :meth:`_recover`); one that does
        not answer within ``pool.restart_timeout_s`` is killed and restarted the same way.
        Out of restarts, it is given up; an engine that raises is a :class:`RolloutEngineError`."""
        import ray

        refs = {i: getattr(self.actors[i], method).remote() for i in self.live_engines}
        died, hung = [], []
        for i, ref in refs.items():
            try:
                ray.get(ref, timeout=self.config.pool.restart_timeout_s)
            except ray.exceptions.RayActorError:
                died.append(i)
            except ray.exceptions.GetTimeoutError:
                hung.append(i)
            except Exception as exc:
                raise RolloutEngineError(f"{self.engine_names[i]}.{method}() failed: {exc}") from exc
        self._sleeping = sleeping  # what the engines brought back below must match
        for i in died + hung:
            logger.warning("%s %s during %s(); restarting it", self.engine_names[i],
                           "died" if i in died else "did not answer", method)  # fmt: skip
        if died:
            self._recover_all(died)
        if hung:
            self.restart(hung)

    def sleep(self) -> None:
        """Release every engine's accelerator memory (colocated placement)."""
        self._call_all("sleep", sleeping=True)

    def wake(self) -> None:
        """Restore every engine's accelerator memory."""
        self._call_all("wake", sleeping=False)

    def health(self) -> list[dict[str, Any]]:
        """One report per engine; a dead or unresponsive engine reports ``ok: False``."""
        import ray

        reports = []
        for i, actor in enumerate(self.actors):
            if i in self._dead:
                reports.append({"ok": False, "engine": self.engine_names[i], "error": self._dead[i]})
                continue
            try:
                report = ray.get(actor.health.remote(), timeout=self.config.pool.restart_timeout_s)
                self._saw_pid(i, report["pid"])
                reports.append(report)
            except Exception as exc:
                reports.append({"ok": False, "engine": self.engine_names[i], "error": f"{type(exc).__name__}: {exc}"})
        return reports

    def answers(self, *, timeout_s: float) -> bool:
        """Whether every engine is live, still in the process it started in (never
        restarted) and answers within ``timeout_s``."""
        import ray

        if self._dead or self.restarts:
            return False
        try:
            pending = [actor.health.remote() for actor in self.actors]
            if ray.wait(pending, num_returns=len(pending), timeout=timeout_s)[1]:
                return False
            return all(report["pid"] == self._pids.get(i) for i, report in enumerate(ray.get(pending)))
        except ray.exceptions.RayError:
            return False

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
        """Shut every engine down (vLLM stops its engine-core processes), then kill the
        actors (no restart) and drop the kept weight buckets."""
        stop_engines(self.actors, live=self.live_engines)
        self._restore_refs = []


def stop_engines(actors: Sequence[Any], *, live: Iterable[int] | None = None, timeout_s: float = 30.0) -> None:
    """Shut the engines of ``actors`` down (those at ``live``; default all), waiting at most
    ``timeout_s`` (a dead or stuck engine must not keep the others alive), then kill every
    actor with no restart."""
    import ray

    live = range(len(actors)) if live is None else live
    try:
        pending = [actors[i].shutdown.remote() for i in live]
        ray.wait(pending, num_returns=len(pending), timeout=timeout_s)
    except Exception:
        pass
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # already gone
            pass
