"""The step loop an RL run (``trainer.py``, ``pipeline.py``) and an SFT run (``sft.py``) share:
resume, then step, evaluate, log and checkpoint on the run's schedule until
``trainer.num_steps`` or a stop signal (``stop.py``). What a step, an evaluation, a
checkpoint and a resume are is each run's own (the hooks below)."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any

from megatron_rl.loop.stop import RunStopped, StopSignals
from megatron_rl.observability import ProgressLine

__all__ = ["StepLoop"]


class StepLoop:
    """Runs ``config.trainer.num_steps`` steps from the step :meth:`resume` returns.

    Subclasses set ``config`` (with ``trainer`` and ``logging`` sections) and implement the
    hooks; ``sink`` (the metrics) and ``actors`` (the actor group: its
    ``consecutive_nonfinite`` count) are theirs too."""

    config: Any
    step: int = 0
    stop: StopSignals | None = None
    """Set by a caller that stops the run on signals."""

    @property
    def stopping(self) -> bool:  # a stop signal came: no step starts, the finished one is saved
        return self.stop is not None and self.stop.requested is not None

    def run(self) -> dict[str, float]:
        """Train to ``trainer.num_steps``; returns the last logged step's metrics."""
        cfg = self.config
        self.step = self.resume()
        last: dict[str, float] = {}
        saved_step = None
        with ExitStack() as stack:
            progress = ProgressLine(cfg.trainer.num_steps, start_step=self.step)
            stack.callback(progress.close)
            if self.step == 0 and cfg.trainer.eval_before_train:  # the starting point, as step 0
                self.sink.log(0, self.evaluate(0))
            self.start_generating(stack)
            # An update already submitted (early, by the pipelined loop) is finished first.
            while self.step < cfg.trainer.num_steps and not (self.stopping and not self.update_in_flight()):
                self.step += 1
                last = self.train_one_step(self.step)
                if cfg.trainer.eval_every_steps and self.step % cfg.trainer.eval_every_steps == 0:
                    last.update(self.evaluate(self.step))
                if self.step % cfg.logging.log_every_steps == 0 or self.step == cfg.trainer.num_steps or self.stopping:
                    self.sink.log(self.step, last)
                    progress.update(self.step, last)
                # After a skipped (non-finite) step the previous checkpoint stays the latest:
                # a run that is diverging must not push its last good state aside.
                if self.save_due(self.step) and self.actors.consecutive_nonfinite == 0:
                    saved_step = self.save_checkpoint() and self.step
        if self.stopping:
            raise RunStopped(self.stop.requested, self.step, saved_step == self.step)
        return last

    def save_due(self, step: int) -> bool:
        every, num_steps = self.config.trainer.save_every_steps, self.config.trainer.num_steps
        # On a stop, the last step is saved: one submitted early still runs after this one.
        return bool((every and step % every == 0) or (step == num_steps and self.config.trainer.save_final)
                    or (self.stopping and not self.update_in_flight()))  # fmt: skip

    # ------------------------------------------------------------------ hooks

    def resume(self) -> int:
        """Load the checkpoint to resume from, if any; the step to continue after."""
        raise NotImplementedError

    def train_one_step(self, step: int) -> dict[str, float]:
        """Step ``step``; its metrics."""
        raise NotImplementedError

    def evaluate(self, step: int) -> dict[str, float]:
        """The eval metrics after step ``step``."""
        raise NotImplementedError

    def save_checkpoint(self) -> Path:
        """An atomic checkpoint of the current step; its path."""
        raise NotImplementedError

    def start_generating(self, stack: ExitStack) -> None:
        """Start work that runs beside the steps (generation ahead); ``stack`` ends it."""

    def update_in_flight(self) -> bool:
        """Whether the next step's update is with the actor already (submitted early)."""
        return False
