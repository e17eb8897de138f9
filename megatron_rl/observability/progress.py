"""A one-line-per-step progress report: step, reward, accuracy, tokens/s, ETA.

On a terminal it is a rich live progress bar with those fields; elsewhere (CI, Slurm
logs) a plain line per logged step, so logs stay greppable.
"""

from __future__ import annotations

import sys
import time


class ProgressLine:
    """Progress of a run of ``num_steps`` steps, starting at ``start_step``."""

    def __init__(self, num_steps: int, *, start_step: int = 0, stream=None):
        self.num_steps = num_steps
        self.start_step = start_step
        self.stream = stream or sys.stderr
        self._t0 = time.perf_counter()
        self._live = None
        if self.stream.isatty():
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self._live = Progress(
                TextColumn("step {task.completed}/{task.total}"),
                BarColumn(),
                TextColumn("{task.fields[info]}"),
                TimeRemainingColumn(),
            )
            self._task = self._live.add_task("train", total=num_steps, completed=start_step, info="")
            self._live.start()

    def update(self, step: int, metrics: dict[str, float]) -> str:
        """Report ``step`` (1-based, completed); returns the plain line."""
        done = step - self.start_step
        elapsed = time.perf_counter() - self._t0
        eta = elapsed / max(done, 1) * (self.num_steps - step)
        parts = [f"step {step}/{self.num_steps}"]
        for key, label in (
            ("rollout/reward/mean", "reward"),
            ("eval/accuracy/mean", "acc"),
            ("throughput/tokens_per_s", "tok/s"),
        ):
            if key in metrics and metrics[key] is not None:
                parts.append(f"{label} {metrics[key]:.3f}" if label != "tok/s" else f"{label} {metrics[key]:.0f}")
        parts.append(f"eta {eta:.0f}s")
        line = " | ".join(parts)
        if self._live is not None:
            self._live.update(self._task, completed=step, info=" | ".join(parts[1:-1]))
        else:
            print(line, file=self.stream, flush=True)
        return line

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
