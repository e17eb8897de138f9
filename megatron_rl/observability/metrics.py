"""One metrics sink: an append-only ``metrics.jsonl`` in the run directory, mirrored to
Weights & Biases (offline unless configured), written by rank 0 only.

Keys are namespaced by what they measure: ``rollout/reward/mean``, ``loss/clip_frac/high``,
``timing_s/generate``, ``tokens/quartile_q1/grad_share``. Each JSONL line is one step:
``{"step": 12, "time": 1732150000.0, "rollout/reward/mean": 0.4, ...}``. Lines are
written and fsync'ed one at a time, so a crash loses at most the line being written (a
full disk loses none: the part written is cut off again, and :class:`DiskFullError`
names the file); when a run starts, lines of steps after the checkpoint it resumes from (every
line, on a fresh start) are dropped (``truncate_after``): they were written by a run that
died before its next checkpoint and are about to be replayed, so each step is logged once.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any

from megatron_rl.storage.durable import DiskFullError, disk_full, fsync_dir


class MetricsSink:
    """Writes metrics to ``run_dir/metrics.jsonl`` and, unless disabled, to wandb.

    Args:
        run_dir: the run directory (created if missing).
        wandb_mode: ``offline`` (local files under ``run_dir/wandb``), ``online`` or ``disabled``.
        project, run_name: wandb project and run name.
        config: the resolved run config (a plain dict) recorded with the wandb run.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        wandb_mode: str = "disabled",
        project: str = "megatron_rl",
        run_name: str = "run",
        config: dict[str, Any] | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        # A raw descriptor, not a buffered file: a failed write (a full disk) leaves no bytes
        # in a buffer that a later flush or close would try again.
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._wandb = None
        if wandb_mode != "disabled":
            # wandb prints a banner and a run summary by default; the progress line and
            # metrics.jsonl already say it all.
            os.environ.setdefault("WANDB_SILENT", "true")
            import wandb  # imported lazily: slow, and not needed with the sink disabled

            self._wandb = wandb.init(
                project=project,
                name=run_name,
                dir=str(self.run_dir),
                mode=wandb_mode,
                config=config or {},
                resume="allow",
                id=_stable_run_id(self.run_dir),
            )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record ``metrics`` for ``step`` (non-finite values are written as null)."""
        clean = {k: (float(v) if _finite(v) else None) for k, v in metrics.items()}
        data = (json.dumps({"step": int(step), "time": time.time(), **clean}, sort_keys=False) + "\n").encode()
        size = os.fstat(self._fd).st_size
        try:
            while data:
                data = data[os.write(self._fd, data):]
            os.fsync(self._fd)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, size)  # no torn line left behind
            if disk_full(e):
                raise DiskFullError(self.path, f"the metrics of step {step}") from e
            raise
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in clean.items() if v is not None}, step=int(step))

    def truncate_after(self, step: int) -> None:
        """Drop lines of steps > ``step`` (and lines without a step): called as a run starts from
        the checkpoint of ``step``, or from scratch with ``step=0``, which drops every line (a
        step-0 line, ``trainer.eval_before_train``'s, is a fresh start's too). Atomic (a
        temporary file replaces the old one)."""
        os.close(self._fd)
        kept = [r for r in read_metrics(self.path) if step > 0 and isinstance(r.get("step"), int) and r["step"] <= step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for r in kept:
                f.write(json.dumps(r) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        fsync_dir(self.path.parent)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a ``metrics.jsonl`` (a torn last line from a crash is skipped)."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # only a crash mid-write produces this, and only on the last line
            if isinstance(record, dict):
                records.append(record)
    return records


def _finite(v: Any) -> bool:
    try:
        return math.isfinite(float(v))
    except (TypeError, ValueError):
        return False


def _stable_run_id(run_dir: Path) -> str:
    """The same wandb run id for the same run directory, so a resumed run continues it."""
    import hashlib

    return hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:16]
