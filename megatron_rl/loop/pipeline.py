"""The pipelined loop: the batches of the next steps are generated while the actor
trains (``rollout.max_staleness >= 1``, one-step-off at 1), and the next step's update
is submitted as soon as this step's sync is done.

:class:`PipelinedTrainer` is the synchronous loop (``trainer.py``) with its batches taken
from :class:`RolloutAhead` and early submission; the order of every update, sync and
generation, and so every number, is the same with early submission as without.
:func:`make_trainer` picks the loop for a config.

The driver's loop asks for step ``n``'s batch with :meth:`RolloutAhead.take`; a batch is
produced by ``produce(step)`` (draw the prompts, generate on the pool). With
``max_staleness = 0`` that happens inline, in ``take``: today's synchronous loop. With
``k >= 1`` a background thread produces batches in step order, and may start step
``m``'s generation as soon as the engines hold weights version ``m - 1 - k`` or newer
(the trainer reports each sync with :meth:`synced`): so every response of step ``m``
comes from weights at most ``k`` versions older than the actor's at that step
(``m - 1``), while the pool works during the update. One-step-off (``k = 1``): step
``n + 1`` generates on version ``n - 1`` while the actor trains step ``n``.

The pool serves one caller at a time: the weight sync, evaluation and anything else
that uses it runs inside :meth:`paused`, which waits for the generation in flight to
finish and holds the next one back. A checkpoint stores :meth:`cursor`, the data
cursor from before the oldest batch not yet trained, so a resumed run draws the prompts
of the batches that were queued or in flight again: none is lost or trained twice (they
are generated again, on the resumed weights).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from functools import partial

from megatron_rl.actor.update import timed
from megatron_rl.config.run import RunConfig
from megatron_rl.loop.experience import RolloutBatch, collect
from megatron_rl.loop.preflight import Preflight
from megatron_rl.loop.step import StartedUpdate, finish_update, step_metrics, submit_update
from megatron_rl.loop.trainer import Trainer
from megatron_rl.loop.warm import WarmWorkers

__all__ = ["PipelinedTrainer", "RolloutAhead", "make_trainer"]


class RolloutAhead:
    """Produces step batches in order, up to ``max_staleness`` weight versions ahead."""

    def __init__(
        self,
        produce: Callable[[int], RolloutBatch],
        *,
        cursor: Callable[[], dict],
        max_staleness: int,
        first_step: int,
        last_step: int,
        synced_version: int,
    ):
        """``produce(step)`` makes step ``step``'s batch (drawing its prompts), ``cursor()``
        reads the data cursor; steps ``first_step..last_step`` are produced; the engines
        hold ``synced_version`` now."""
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self.max_staleness = max_staleness
        self._produce = produce
        self._read_cursor = cursor
        self._in_flight_cursor: dict | None = None
        self._next = first_step
        self._last = last_step
        self._synced = synced_version
        self._ready: deque[RolloutBatch] = deque()
        self._busy = False
        self._paused = 0
        self._closed = False
        self._error: BaseException | None = None
        self._idle_s = 0.0
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        if max_staleness > 0:
            self._thread = threading.Thread(target=self._loop, name="rollout-ahead", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ the trainer's side

    def take(self, step: int) -> tuple[RolloutBatch, float]:
        """Step ``step``'s batch (steps must be taken in order) and the seconds the caller
        waited for it (0 inline: the generation is the batch's ``generate_s``)."""
        if self._thread is None:
            if step != self._next:
                raise RuntimeError(f"asked for step {step}'s batch; the next one is step {self._next}")
            self._next += 1
            cursor = self._read_cursor()
            batch = self._produce(step)
            batch.cursor = cursor
            return batch, 0.0
        start = time.perf_counter()
        with self._cond:
            while not self._ready and self._error is None:
                self._cond.wait()
            if not self._ready:  # the batches before the failure are trained first
                raise self._error
            batch = self._ready.popleft()
            self._cond.notify_all()
        if batch.step != step:
            raise RuntimeError(f"asked for step {step}'s batch; the next one is step {batch.step}")
        return batch, time.perf_counter() - start

    def ready(self, step: int) -> bool:
        """Whether step ``step``'s batch is generated and next in line (:meth:`take` returns at once)."""
        with self._cond:
            return bool(self._ready) and self._ready[0].step == step

    def synced(self, version: int) -> None:
        """The engines now hold weights ``version``: later steps may start generating."""
        with self._cond:
            self._synced = version
            self._cond.notify_all()

    @contextmanager
    def paused(self) -> Iterator[float]:
        """Hold generation back for the block (the pool is the caller's); yields the seconds
        waited for the generation in flight to finish."""
        start = time.perf_counter()
        with self._cond:
            self._paused += 1
            while self._busy:
                self._cond.wait()
        try:
            yield time.perf_counter() - start
        finally:
            with self._cond:
                self._paused -= 1
                self._cond.notify_all()

    def cursor(self) -> dict:
        """The data cursor to checkpoint: from before the oldest batch not yet trained
        (queued or in flight), or the sampler's own when there is none."""
        with self._cond:
            if self._ready:
                return self._ready[0].cursor
            if self._busy:
                return self._in_flight_cursor
            return self._read_cursor()  # the producer is idle: nothing draws meanwhile

    def pool_idle_s(self) -> float:
        """Seconds the background producer waited (for newer weights or a pause to end) since the last call."""
        with self._cond:
            idle, self._idle_s = self._idle_s, 0.0
        return idle

    def close(self) -> None:
        """Stop producing; waits for the generation in flight (the pool is shut down after)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()

    # ------------------------------------------------------------------ the producer

    def _may_start(self) -> bool:
        # The version bound also bounds the queue: at most max_staleness + 1 batches wait.
        return not self._paused and self._next <= min(self._last, self._synced + 1 + self.max_staleness)

    def _loop(self) -> None:
        while True:
            with self._cond:
                waited = time.perf_counter()
                while not self._closed and not self._may_start():
                    self._cond.wait()
                if self._closed:
                    return
                self._idle_s += time.perf_counter() - waited
                step, self._busy = self._next, True
                self._in_flight_cursor = self._read_cursor()
            try:
                batch = self._produce(step)
                batch.cursor = self._in_flight_cursor
            except BaseException as exc:  # noqa: BLE001  (re-raised in the trainer's take)
                with self._cond:
                    self._error, self._busy = exc, False
                    self._cond.notify_all()
                return
            with self._cond:
                self._ready.append(batch)
                self._next += 1
                self._busy = False
                self._cond.notify_all()


class PipelinedTrainer(Trainer):
    """The loop with rollout ahead of the update (``rollout.max_staleness >= 1``, disaggregated).

    ``submit_early``: submit step ``n + 1``'s update at the end of step ``n`` when its
    batch is ready (the actor then runs it while the driver logs and evaluates step ``n``);
    off, each update is submitted at its own step. Every number is the same either way.
    """

    generates_ahead = True

    def __init__(self, config: RunConfig, *, checked: Preflight | None = None, submit_early: bool = True,
                 warm: WarmWorkers | None = None):
        super().__init__(config, checked=checked, warm=warm)
        self.submit_early = submit_early
        self.ahead: RolloutAhead | None = None
        self._next: StartedUpdate | Exception | None = None
        """The next step's update, submitted at the end of this one (:meth:`_submit_next`)."""

    def start_generating(self, stack: ExitStack) -> None:
        cfg = self.config
        self.ahead = RolloutAhead(partial(collect, self.parts), cursor=self.parts.prompts.state_dict,
                                  max_staleness=cfg.rollout.max_staleness, first_step=self.step + 1,
                                  last_step=cfg.trainer.num_steps, synced_version=self.step)  # fmt: skip
        stack.callback(self.ahead.close)

    def train_one_step(self, step: int) -> dict[str, float]:
        r, start = self.parts, time.perf_counter()
        started, self._next = self._next, None
        if isinstance(started, BaseException):  # raised while submitting this step early: now it is its turn
            raise started
        early = started is not None
        started = started or self._submit(step)
        metrics = finish_update(r, started)
        metrics["pipeline/submitted_early"] = float(early)  # at the end of the step before
        timings = started.timings
        with self.ahead.paused() as waited:  # the pool finishes the generation in flight first
            with timed(timings, "weight_sync"):
                metrics.update(r.weight_sync.run(step))
            # Before the generation resumes: the driver's thread is not sharing the
            # interpreter with an engine in the driver's process.
            self._submit_next(step)
        self.ahead.synced(step)
        timings["actor_wait_rollout"] += waited
        timings["rollout_wait_actor"] = self.ahead.pool_idle_s()
        return step_metrics(metrics, timings, started.exp, start)

    def _submit(self, step: int) -> StartedUpdate:
        batch, waited = self.ahead.take(step)
        timings = {"generate": batch.generate_s, "actor_wait_rollout": waited}  # generated during earlier updates
        return submit_update(self.parts, batch, timings, self.reward_errors, prepare_sync=True)

    def _submit_next(self, step: int) -> None:
        """Submit step ``step + 1``'s update now if its batch is ready and nothing reads the
        actor's state before that update would change it (a checkpoint)."""
        last = step >= self.config.trainer.num_steps
        if not self.submit_early or last or self.save_due(step) or not self.ahead.ready(step + 1):
            return
        try:
            self._next = self._submit(step + 1)
        except Exception as exc:  # noqa: BLE001  (raised at its own step, after this one is logged)
            self._next = exc

    def update_in_flight(self) -> bool:
        return self._next is not None  # submitted early: it runs (and is saved) before the loop stops

    def evaluate(self, step: int) -> dict[str, float]:
        if self.ahead is None:  # before generation starts (trainer.eval_before_train)
            return super().evaluate(step)
        with self.ahead.paused():  # the pool is evaluation's meanwhile
            return super().evaluate(step)

    def data_cursor(self) -> dict:
        # From before the oldest batch not trained yet: a resumed run draws the prompts of
        # batches generated ahead again (none lost, none trained twice).
        return self.ahead.cursor()


def make_trainer(config: RunConfig, *, checked: Preflight | None = None, warm: WarmWorkers | None = None) -> Trainer:
    """The loop for ``config``: pipelined with ``rollout.max_staleness >= 1``, else synchronous
    (``warm``: actor ranks and engines kept between this process's runs, ``loop.warm``)."""
    cls = PipelinedTrainer if config.rollout.max_staleness > 0 else Trainer
    return cls(config, checked=checked, warm=warm)
