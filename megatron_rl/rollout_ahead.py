"""Rollout ahead of the update: the batches of the next steps are generated while the
actor trains (``rollout.max_staleness``).

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
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = ["RolloutAhead", "RolloutBatch"]


@dataclass(kw_only=True)
class RolloutBatch:
    """What ``produce(step)`` returns: one RL step's prompts, completions and their rewards."""

    step: int
    """The RL step that trains on it."""
    prompts: Any
    """The drawn prompts (``data.prompts``' batch: token ids, rows, texts)."""
    completions: list
    """Per prompt, its completions (``rollout.base.Completion``), in prompt order."""
    generate_s: float
    """Seconds the generation took."""
    rewards: list | None = None
    """The reward results of every response, prompt-major (``rewards.RewardResult``): scored
    by the producer right after generation, so ahead of the update when the batch is."""
    reward_s: float = 0.0
    """Seconds the scoring took."""
    experience: Any = None
    """The update's padded batch of prompts and responses (``experience.Experience``), built
    by the producer too, so it is ready when the trainer takes the batch."""
    cursor: dict | None = None
    """The data cursor (sampler state) from before these prompts were drawn (set by
    :class:`RolloutAhead`)."""


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
