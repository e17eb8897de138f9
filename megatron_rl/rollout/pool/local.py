"""One rollout engine inside the driver's process (``rollout.engine_process: driver``).

:class:`LocalRolloutPool` answers the calls the trainer, the weight sync and the
evaluation make of :class:`~megatron_rl.rollout.pool.pool.RolloutPool` with the same results,
for one engine that is an object of the driver instead of a Ray actor: the same
:class:`~megatron_rl.rollout.pool.worker.EngineWorker` body, the same request split and
prompt seeds (so a seeded call samples the same tokens as a one-engine Ray pool), the
same begin -> buckets -> commit weight update, fed from the actor's buckets in the object
store. What a process of its own buys is gone, and so are the settings for it: no
restarts and no time-outs (an engine failure raises :class:`RolloutEngineError` and
stops the run), no transfer groups (``RolloutConfig`` refuses those settings).

Why: on a small CPU machine the engine's own process holds a second copy of torch,
transformers and a Ray worker: the layout saves about 0.3 GB of the CPU benchmark's 1.77 GB
of summed PSS (docs/benchmarks.md). With
``rollout.max_staleness >= 1`` the driver's rollout-ahead thread generates while the
driver's main thread waits on the actor, which releases the GIL.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

from megatron_rl.config.rollout import RolloutConfig
from megatron_rl.rollout.generation import Completion, SamplingParams
from megatron_rl.rollout.pool.dispatch import plan_call
from megatron_rl.rollout.pool.recovery import RolloutEngineError
from megatron_rl.rollout.pool.worker import EngineWorker
from megatron_rl.weight_sync.buckets import WeightBucket, sync_stats
from megatron_rl.weight_sync.meta import TensorMeta

__all__ = ["LocalRolloutPool"]

logger = logging.getLogger(__name__)


class LocalRolloutPool:
    """``RolloutPool``'s interface over one engine in this process.

    Args:
        config: the ``rollout`` section (``engine_process: driver``, checked there).
        model_path: HF model directory the engine loads (weights version 0).
        torch_threads: intra-op threads of this process while it generates (the engine's
            CPU share; set once, for the whole driver process).
        name_prefix: the engine is named ``{name_prefix}-0``.
        weight_format: the updates' wire format (``rollout.weight_dtype``).
    """

    def __init__(
        self, config: RolloutConfig, model_path: str, *, torch_threads: int = 1, name_prefix: str = "rollout",
        weight_format: str = "auto",
    ):  # fmt: skip
        if config.engine_process != "driver":
            raise ValueError(f"LocalRolloutPool needs rollout.engine_process: driver, got {config.engine_process!r}")
        self.config = config
        self.model_path = str(model_path)
        self.engine_names = [f"{name_prefix}-0"]
        self.weight_backend = "object_store"
        try:
            self.worker = EngineWorker(config.engine, self.model_path, dict(config.engine_args), self.engine_names[0],
                                       torch_threads, "object_store", None, weight_format, 1,
                                       config.routing_replay)  # fmt: skip
        except Exception as exc:
            raise RolloutEngineError(f"{self.engine_names[0]} failed to start: {exc}") from exc
        self._version = 0
        # The rollout-ahead thread generates while the trainer's thread syncs weights only
        # inside RolloutAhead.paused(); this lock makes any other overlap wait, not interleave.
        self._lock = threading.Lock()
        self.restorer = None
        """Unused (nothing restarts); kept for ``WeightSync``, which sets it for collective transports."""
        self.restarts = 0
        self.last_stats: dict[str, float] = {}

    # ------------------------------------------------------------------ properties

    @property
    def num_engines(self) -> int:
        return 1

    @property
    def live_engines(self) -> list[int]:
        return [0]

    @property
    def weight_version(self) -> int:
        """Version of the last completed weight sync (0 = initial checkpoint)."""
        return self._version

    # ------------------------------------------------------------------ generation

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        """``params.n`` completions per prompt, in prompt order (``RolloutPool.generate``'s
        contract and seeds; the requests run one after the other)."""
        start = time.perf_counter()
        num_prompts = len(prompts)
        if num_prompts == 0:
            return []
        prompts, seeds, requests = plan_call(prompts, params, num_live=1,
                                             max_prompts_per_request=self.config.pool.max_prompts_per_request)  # fmt: skip
        results: list[list[Completion]] = []
        with self._lock:
            for req in requests:
                try:
                    out = self.worker.generate(prompts[req.lo : req.hi], params, seeds[req.lo : req.hi])
                except Exception as exc:
                    raise RolloutEngineError(
                        f"{self.engine_names[0]} raised on {req.describe(num_prompts)}: {exc}"
                    ) from exc
                if len(out) != req.hi - req.lo:
                    raise RolloutEngineError(
                        f"{self.engine_names[0]} returned {len(out)} groups for {req.describe(num_prompts)}"
                    )
                results.extend(out)
        self.last_stats = {
            "timing_s/generate": time.perf_counter() - start,
            "rollout/num_requests": float(len(requests)),
            "rollout/num_retries": 0.0,
            "rollout/num_generated_tokens": float(sum(len(c) for group in results for c in group)),
        }
        return results

    # ------------------------------------------------------------------ weights

    def client(self, engines: Sequence[int] | None = None) -> Any:
        raise RolloutEngineError("an engine in the driver's process has no transfer group (object store only)")

    def begin_update(self, version: int, metas: list[TensorMeta], *, engines: Sequence[int] | None = None) -> list[int]:
        """Open the update to ``version``; the engine checks ``metas`` first (a refusal
        raises naming the engine and the version, and the weights stay as they were)."""
        try:
            self.worker.begin_weight_update(int(version), metas)
        except Exception as exc:
            self.abort_update([0])
            raise RolloutEngineError(f"{self.engine_names[0]}: opening weight update to version {version}: {exc}") \
                from exc  # fmt: skip
        return [0]

    def commit_update(self, version: int, engines: Sequence[int]) -> None:
        committed = self.worker.commit_weight_update()
        if committed != version:
            raise RolloutEngineError(f"{self.engine_names[0]} committed version {committed}, expected {version}")
        self._version = int(version)

    def abort_update(self, engines: Sequence[int]) -> None:
        try:
            self.worker.abort_weight_update()
        except Exception as exc:  # best effort, as the Ray pool's
            logger.warning("%s: aborting the weight update failed: %s", self.engine_names[0], exc)

    def sync(self, buckets: Iterable[WeightBucket | Any], *, version: int, metas: list[TensorMeta]) -> dict[str, float]:
        """One version from ``buckets`` (buckets, or ObjectRefs of the actor's) into the engine;
        the same statistics as ``RolloutPool.sync`` (``put_seconds``: fetching the refs)."""
        import ray

        start = time.perf_counter()
        if version < self._version:
            logger.warning("weight sync to version %d is older than the pool's %d", version, self._version)
        with self._lock:
            self.begin_update(version, metas)
            num_buckets, get_seconds = 0, 0.0
            try:
                for bucket in buckets:
                    t0 = time.perf_counter()
                    if isinstance(bucket, ray.ObjectRef):
                        bucket = ray.get(bucket)
                    get_seconds += time.perf_counter() - t0
                    self.worker.load_bucket(bucket)
                    num_buckets += 1
                    del bucket
            except BaseException as exc:
                self.abort_update([0])
                if isinstance(exc, Exception) and not isinstance(exc, RolloutEngineError):
                    raise RolloutEngineError(f"{self.engine_names[0]} failed to load weight version {version}: {exc}") \
                        from exc  # fmt: skip
                raise
            self.commit_update(version, [0])
        return sync_stats(time.perf_counter() - start, put_seconds=get_seconds, metas=metas, num_buckets=num_buckets,
                          num_engines=1, version=version)  # fmt: skip

    def restart(self, engines: Iterable[int], *, restore: bool = True) -> None:
        raise RolloutEngineError(f"{self.engine_names[0]} runs in the driver's process and cannot be restarted "
                                 "(rollout.engine_process: ray_actor restarts engines)")  # fmt: skip

    # ------------------------------------------------------------------ lifecycle

    def sleep(self) -> None:
        self.worker.sleep()

    def wake(self) -> None:
        self.worker.wake()

    def health(self) -> list[dict[str, Any]]:
        try:
            return [self.worker.health()]
        except Exception as exc:
            return [{"ok": False, "engine": self.engine_names[0], "error": f"{type(exc).__name__}: {exc}"}]

    def node_ids(self) -> list[str | None]:
        import ray

        return [ray.get_runtime_context().get_node_id()]

    def __enter__(self) -> LocalRolloutPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        try:
            self.worker.shutdown()
        except Exception as exc:
            logger.warning("%s: shutdown failed: %s", self.engine_names[0], exc)
