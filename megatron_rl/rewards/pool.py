"""Scoring a batch of responses with a hard time limit per sample.

A reward function may hang on a pathological response (sympy simplification, a
catastrophic regex in user code), and Python cannot interrupt a thread from outside.
So :class:`RewardPool` runs the function in worker processes it can kill: each sample
gets ``timeout_s`` seconds; a sample that runs past it scores the function's
``failure_score`` with ``timed_out`` set, its worker is killed and a fresh one started.
An exception, a non-number, or a worker that dies also scores ``failure_score`` and is
counted; nothing a reward function does can crash or stall the trainer.

Workers are started with ``spawn`` (no inherited CUDA, Ray or torch thread state) and are
kept between batches; start-up (Python plus the function's imports, about a second) is
not counted against any sample's limit. A worker dies with the process that started it,
even when that one is killed with SIGKILL and cannot clean up: on Linux the kernel sends
it SIGKILL (``prctl(PR_SET_PDEATHSIG)``; the parent *thread* counts, so score from a
long-lived thread such as the main one), elsewhere a watch thread exits when the parent
is gone. A worker cannot take the trainer down by eating memory: its address space is
capped (``memory_mb``, ``resource.setrlimit(RLIMIT_AS)``: the reward gets a
``MemoryError``, which scores as a failure) and its ``oom_score_adj`` is 1000, so when the
machine runs out anyway the kernel kills a reward worker (scored as a failure and
replaced) before the actor ranks and engines. A score beyond ``max_abs_score`` (a reward
returning 1e308 overflows the advantages into a non-finite loss) is a failure naming the
reward and the bound. The function is sent to the workers by pickle,
so it must be importable by name (a registered reward, a ``module:function``, or any
module-level function); a lambda or closure is refused when the pool is created.

:func:`score_batch` is the one-call form returning ``(scores, metrics)`` with the counts
``reward/parse_failures`` (every sample scored as a failure, whatever the cause),
``reward/timeouts`` and ``reward/exceptions`` (raised, returned a non-number, or its
worker died). :class:`RewardErrorStreak` turns "the reward failed on every response" for
several steps in a row into an error: such a run learns nothing.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megatron_rl.config.lib import MAX_TIMEOUT_S
from megatron_rl.rewards.registry import (
    RewardFunction,
    RewardResult,
    as_reward,
    call_reward,
    crash_result,
    timeout_result,
)

DEFAULT_TIMEOUT_S = 10.0
"""Default hard limit per sample, in seconds (math-verify's own limits are 2 s per call)."""

DEFAULT_START_TIMEOUT_S = 120.0
"""How long a worker may take to start and import the reward function."""


_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def _die_with_parent(parent_pid: int) -> None:
    """Make this process exit when ``parent_pid`` (the pool's process) goes away."""
    armed = False
    if sys.platform.startswith("linux"):
        try:
            armed = ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
        except (OSError, AttributeError):
            armed = False
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(1)
    if not armed:

        def watch() -> None:
            while os.getppid() == parent_pid:
                time.sleep(0.5)
            os._exit(1)

        threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _limit_memory(memory_mb: int | None) -> None:
    """This worker first in line for the OOM killer, and its address space capped at ``memory_mb``."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:  # raising it needs no privilege
            f.write("1000")
    except OSError:
        pass  # not Linux
    if memory_mb:
        import resource

        limit = memory_mb << 20
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _worker_main(
    conn: multiprocessing.connection.Connection, payload: bytes, parent_pid: int, memory_mb: int | None = None
) -> None:
    """Worker process: load the function, then score tasks until told to stop."""
    _die_with_parent(parent_pid)
    _limit_memory(memory_mb)
    try:
        fn = pickle.loads(payload)
    except BaseException as e:  # report any import failure instead of dying silently
        conn.send(("init_error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready",))
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):  # the pool went away
            return
        if task is None:
            return
        index, response, ground_truth, prompt = task
        result = call_reward(fn, response, ground_truth, prompt=prompt)
        try:
            conn.send(("done", index, result))
        except Exception as e:  # e.g. unpicklable extras; pickling fails before anything is written
            conn.send(("done", index, crash_result(fn, f"{type(e).__name__}: cannot send the result back: {e}")))


@dataclass(kw_only=True)
class _Worker:
    """One worker process and what it is doing."""

    process: Any
    """The ``multiprocessing`` process."""

    conn: multiprocessing.connection.Connection
    """The parent's end of the pipe."""

    state: str = "starting"
    """``starting`` (until it reports ready), ``idle`` or ``busy``."""

    index: int = -1
    """Sample being scored while ``busy``."""

    deadline: float = 0.0
    """``time.monotonic()`` by which the current task (or start-up) must finish."""


def _stop_workers(workers: list[_Worker]) -> None:
    """Ask idle workers to exit, then kill whatever is still alive (used by close and GC)."""
    for w in workers:
        if w.state == "idle":
            try:
                w.conn.send(None)
            except OSError:
                pass
    for w in workers:
        w.process.join(timeout=1.0 if w.state == "idle" else 0.0)
        if w.process.is_alive():
            w.process.kill()
            w.process.join(timeout=5.0)
        w.conn.close()
    workers.clear()


class RewardPool:
    """Worker processes that score responses with one reward function, ``timeout_s`` per sample.

    Use as a context manager (or call :meth:`close`)::

        from megatron_rl.tasks import get_reward  # the built-in names resolve once tasks are imported

        with RewardPool(get_reward("math"), num_workers=4, timeout_s=10) as pool:
            results = pool.score(responses, ground_truths, prompts)
    """

    def __init__(
        self,
        fn: RewardFunction | str,
        *,
        num_workers: int = 1,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
        memory_mb: int | None = None,
        max_abs_score: float | None = None,
    ):
        """``memory_mb``: each worker's address-space cap (None: no cap); ``max_abs_score``:
        a score beyond ±this is a failure (None: any finite score)."""
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if not 0 < timeout_s <= MAX_TIMEOUT_S or not 0 < start_timeout_s <= MAX_TIMEOUT_S:
            # Past about 2.1e6 s the waits below overflow (OverflowError at the first batch).
            raise ValueError(
                f"timeouts must be in (0, {MAX_TIMEOUT_S:g}] s, got timeout_s={timeout_s}, "
                f"start_timeout_s={start_timeout_s}"
            )
        self.fn = as_reward(fn)
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.start_timeout_s = float(start_timeout_s)
        self.memory_mb, self.max_abs_score = memory_mb, max_abs_score
        try:
            self._payload = pickle.dumps(self.fn)
        except Exception as e:
            raise ValueError(
                f"reward {self.fn.name!r} cannot be sent to a worker process ({type(e).__name__}: {e}); "
                "use a module-level function (registered, or given as 'module:function')"
            ) from None
        self._ctx = multiprocessing.get_context("spawn")
        self._workers: list[_Worker] = []
        self._finalizer = weakref.finalize(self, _stop_workers, self._workers)

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop all workers (idempotent)."""
        self._finalizer()

    def start(self) -> None:
        """Start every worker now, so the first batch does not wait for them: they report ready
        in the background (:meth:`score` starts them on demand otherwise). A worker that
        cannot load the reward fails the first :meth:`score`, as it would have anyway."""
        while len(self._workers) < self.num_workers:
            self._start_worker()

    def _start_worker(self) -> None:
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(
            target=_worker_main,
            args=(child_conn, self._payload, os.getpid(), self.memory_mb),
            daemon=True,
            name=f"reward-{self.fn.name}",
        )
        process.start()
        child_conn.close()  # the child holds its own copy; closing ours makes its death visible as EOF
        self._workers.append(
            _Worker(process=process, conn=parent_conn, deadline=time.monotonic() + self.start_timeout_s)
        )

    def _discard(self, worker: _Worker) -> None:
        """Kill a worker (hung, dead or failed) and forget it; a new one starts when needed."""
        if worker.process.is_alive():
            worker.process.kill()
        worker.process.join(timeout=5.0)
        worker.conn.close()
        self._workers.remove(worker)

    # ------------------------------------------------------------------ scoring

    def score(
        self, responses: Sequence[str], ground_truths: Sequence[Any], prompts: Sequence[str] | None = None
    ) -> list[RewardResult]:
        """One :class:`RewardResult` per response, in order; never raises for a reward's failure.

        Raises ``RuntimeError`` only when a worker cannot start (e.g. the function's module
        fails to import in a fresh process) or the pool is closed.
        """
        if not self._finalizer.alive:
            raise RuntimeError("RewardPool is closed")
        n = len(responses)
        prompts = [""] * n if prompts is None else prompts
        if len(ground_truths) != n or len(prompts) != n:
            raise ValueError(
                f"got {n} responses, {len(ground_truths)} ground truths and {len(prompts)} prompts; need equal counts"
            )
        results: list[RewardResult | None] = [None] * n
        pending = deque(range(n))
        try:
            self._run(pending, results, responses, ground_truths, prompts)
        except BaseException:
            # Never leave a worker holding a task of this call: the next call must start clean.
            for w in [w for w in self._workers if w.state != "idle"]:
                self._discard(w)
            raise
        return results  # type: ignore[return-value]  # every slot is filled by _run

    def _run(self, pending, results, responses, ground_truths, prompts) -> None:
        while pending or any(w.state == "busy" for w in self._workers):
            # Start workers while there is more pending work than idle/starting workers to take it.
            while len(self._workers) < self.num_workers and len(pending) > sum(
                w.state != "busy" for w in self._workers
            ):
                self._start_worker()
            now = time.monotonic()
            for w in [w for w in self._workers if w.state == "idle"]:
                if not pending:
                    break
                i = pending.popleft()
                try:
                    w.conn.send((i, responses[i], ground_truths[i], prompts[i]))
                except (BrokenPipeError, ConnectionResetError):  # died while idle (e.g. killed for memory)
                    pending.appendleft(i)
                    self._discard(w)
                    continue
                w.state, w.index, w.deadline = "busy", i, now + self.timeout_s
            waiting = [w for w in self._workers if w.state != "idle"]
            if not waiting:
                continue
            wait_s = max(0.0, min(w.deadline for w in waiting) - now)
            ready = multiprocessing.connection.wait([w.conn for w in waiting], timeout=wait_s)
            for w in [w for w in waiting if w.conn in ready]:
                self._receive(w, results)
            now = time.monotonic()
            for w in [w for w in self._workers if w.state != "idle" and w.deadline <= now]:
                if w.state == "starting":
                    self._discard(w)
                    raise RuntimeError(
                        f"reward worker for {self.fn.name!r} did not start within {self.start_timeout_s:g} s"
                    )
                results[w.index] = timeout_result(self.fn, self.timeout_s)
                self._discard(w)

    def _receive(self, w: _Worker, results: list[RewardResult | None]) -> None:
        try:
            message = w.conn.recv()
        except (EOFError, OSError):
            w.process.join(timeout=5.0)
            code = w.process.exitcode
            starting = w.state == "starting"
            self._discard(w)
            if starting:
                raise RuntimeError(
                    f"reward worker for {self.fn.name!r} exited during start-up (exit code {code})"
                ) from None
            results[w.index] = crash_result(
                self.fn, f"RuntimeError: the reward worker process died while scoring (exit code {code})"
            )
            return
        kind = message[0]
        if kind == "ready":
            w.state = "idle"
        elif kind == "init_error":
            self._discard(w)
            raise RuntimeError(f"reward worker cannot load reward {self.fn.name!r}: {message[1]}")
        else:  # "done"
            result = message[2]
            if self.max_abs_score is not None and abs(result.score) > self.max_abs_score:
                result = crash_result(self.fn, f"ValueError: reward {self.fn.name!r} returned {result.score!r}, beyond "
                                      f"±{self.max_abs_score:g} (data.max_abs_reward)")  # fmt: skip
            results[message[1]] = result
            w.state = "idle"


def summarize(results: Sequence[RewardResult]) -> tuple[list[float], dict[str, int]]:
    """Scores and the failure counts of a batch (metric names as logged by the trainer)."""
    scores = [r.score for r in results]
    metrics = {
        "reward/parse_failures": sum(r.parse_failed for r in results),
        "reward/timeouts": sum(r.timed_out for r in results),
        "reward/exceptions": sum(r.error is not None and not r.timed_out for r in results),
    }
    return scores, metrics


class AllRewardsFailedError(RuntimeError):
    """The reward failed (raised or timed out) on every response for several steps in a row."""


class RewardErrorStreak:
    """Counts training steps in a row in which the reward failed on EVERY response.

    Such a step scores every response ``failure_score``: the advantages are all zero and
    nothing is learnt, yet the run looks healthy but for a counter (a ground truth the
    reward cannot read does this). ``limit`` such steps in a row raise
    :class:`AllRewardsFailedError` quoting one of the errors; a step with one scored
    response resets the count.
    """

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.limit = limit
        self.count = 0
        """Steps in a row so far whose every response failed."""

    def update(self, step: int, results: Sequence[RewardResult]) -> None:
        """Record step ``step``'s results; raises once ``limit`` steps in a row failed entirely."""
        failed = [r for r in results if r.error is not None]
        self.count = self.count + 1 if results and len(failed) == len(results) else 0
        if self.count >= self.limit:
            raise AllRewardsFailedError(
                f"the reward failed on every response for {self.count} steps in a row "
                f"(trainer.max_consecutive_reward_error_steps={self.limit}), so the run learns nothing; "
                f"e.g. {failed[0].error}"
            )

    def state_dict(self) -> dict[str, int]:
        return {"reward_error_steps": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = int(state.get("reward_error_steps", 0))


def score_batch(
    fn: RewardFunction | str,
    responses: Sequence[str],
    ground_truths: Sequence[Any],
    *,
    prompts: Sequence[str] | None = None,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    pool: RewardPool | None = None,
) -> tuple[list[float], dict[str, int]]:
    """Score a batch; returns ``(scores, metrics)`` (see :func:`summarize`).

    Args:
        fn: a :class:`RewardFunction`, a registered name or a ``module:function`` spec.
        responses: generated texts (without the prompt).
        ground_truths: one per response.
        prompts: the rendered prompts (default empty strings).
        timeout_s: hard limit per sample. Without ``pool``, a one-worker pool is started
            for this call (about a second); ``None`` scores in this process with no time
            limit (exceptions are still caught) -- only for functions known to be fast.
        pool: a long-lived :class:`RewardPool` for ``fn`` (what the trainer uses);
            ``timeout_s`` is then the pool's.
    """
    fn = as_reward(fn)
    if pool is not None:
        if pool.fn != fn:
            raise ValueError(f"pool scores {pool.fn.name!r}, not {fn.name!r}")
        return summarize(pool.score(responses, ground_truths, prompts))
    if timeout_s is None:
        n = len(responses)
        if len(ground_truths) != n or (prompts is not None and len(prompts) != n):
            raise ValueError("responses, ground_truths and prompts must have equal lengths")
        prompts = [""] * n if prompts is None else prompts
        return summarize([call_reward(fn, r, g, prompt=p) for r, g, p in zip(responses, ground_truths, prompts)])
    with RewardPool(fn, timeout_s=timeout_s) as temporary:
        return summarize(temporary.score(responses, ground_truths, prompts))
