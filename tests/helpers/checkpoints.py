"""Stand-in training checkpoints: the files of a real one, written in milliseconds.

``make_checkpoint`` writes what ``megatron_rl.storage.checkpoints`` checks (the driver's
state in ``actor_state.json``, ``metadata.json``, ``.metadata``, ``common.pt``, a shard, an
RNG file, the manifest) and points ``latest`` at it; nothing in it can be loaded by the
actor. The optimizer settings default to those of ``examples/tiny_cpu.yaml``.
:data:`CORRUPTIONS` damages a real run's checkpoints (``tests/e2e/test_reliability.py`` and
``tools/reliability_campaign.py`` share it).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatron_rl.storage.checkpoints import checkpoint_files, file_digest, write_latest, write_manifest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu.yaml"


def tiny_scheduler() -> dict[str, Any]:
    """The scheduler state a run of ``examples/tiny_cpu.yaml`` saves (its optimizer settings)."""
    from megatron_rl.config.run import load_run_config

    t = load_run_config(EXAMPLE).trainer
    return {"max_lr": t.lr, "min_lr": t.min_lr, "lr_warmup_steps": t.lr_warmup_steps, "lr_decay_style": t.lr_schedule,
            "lr_decay_steps": 800, "num_steps": 8, "start_wd": t.weight_decay, "end_wd": t.weight_decay}  # fmt: skip


def tiny_adam() -> dict[str, float]:
    from megatron_rl.config.run import load_run_config

    t = load_run_config(EXAMPLE).trainer
    return {"beta1": t.adam_beta1, "beta2": t.adam_beta2, "eps": t.adam_eps}


def make_checkpoint(folder: Path, step: int, *, num_rows: int = 800, manifest: bool = True, **record: Any) -> Path:
    """``folder/step_NNNNNN`` with a trainer state at ``step``; ``record`` adds to or replaces
    ``actor_state.json`` entries (``scheduler``, ``adam``)."""
    path = folder / f"step_{step:06d}"
    (path / "rng").mkdir(parents=True)
    state = {
        "layout": {"tp": 1, "pp": 1, "dp": 1},
        "scheduler": tiny_scheduler(),
        "adam": tiny_adam(),
        "trainer": {"step": step, "sampler": {"epoch": 0, "position": 8 * step, "num_rows": num_rows}},
        **record,
    }
    (path / "actor_state.json").write_text(json.dumps(state))
    (path / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (path / ".metadata").write_bytes(b"dcp-metadata" * 10)
    (path / "common.pt").write_bytes(b"common" * 10)
    (path / "__0_0.distcp").write_bytes(bytes(range(256)) * 40)
    (path / "rng" / "rank0.pt").write_bytes(b"rng-state" * 10)
    if manifest:
        write_manifest(path, {name: file_digest(path / name) for name in checkpoint_files(path)})
    write_latest(folder, path.name)
    return path


# --------------------------------------------------------------------------- corrupting a real checkpoint


def largest_shard(step: Path) -> Path:
    """The biggest tensor file of a checkpoint (the one holding the weights)."""
    return max(step.glob("*.distcp"), key=lambda p: p.stat().st_size)


def flip_a_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _zero(path: Path) -> None:
    path.write_bytes(bytes(path.stat().st_size))


def _write(path: Path, text: str) -> None:
    path.write_text(text)


CORRUPTIONS: dict[str, Callable[[Path], object]] = {
    "truncated_shard": lambda c: os.truncate(largest_shard(c / "step_000002"), 1000),
    "zeroed_shard": lambda c: _zero(largest_shard(c / "step_000002")),
    "bit_flipped_shard": lambda c: flip_a_bit(largest_shard(c / "step_000002")),
    "deleted_metadata": lambda c: (c / "step_000002" / ".metadata").unlink(),
    "deleted_metadata_json": lambda c: (c / "step_000002" / "metadata.json").unlink(),
    "truncated_common": lambda c: os.truncate(c / "step_000002" / "common.pt", 10),
    "truncated_rng": lambda c: os.truncate(c / "step_000002" / "rng" / "rank0.pt", 10),
    "bad_actor_state": lambda c: _write(c / "step_000002" / "actor_state.json", '{"trainer": '),
    "dangling_latest": lambda c: _write(c / "latest", "step_000009\n"),
    "empty_latest": lambda c: _write(c / "latest", ""),
    "latest_outside": lambda c: _write(c / "latest", "../../other/tiny_cpu/checkpoints/step_000002\n"),
}
"""The corruptions of issue 17, applied to the checkpoint folder ``c`` of a real run whose
latest checkpoint is ``step_000002`` (``c/../../other`` may hold another run)."""
