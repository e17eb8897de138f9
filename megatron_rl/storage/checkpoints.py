"""Checkpoints as files: an integrity manifest, the ``latest`` pointer, and
the choice of the checkpoint to resume from, falling back past broken ones.

The actor writes a checkpoint (``actor/checkpoint/save_load.py``); this module holds what the
driver must know about one WITHOUT loading it, so it imports only the standard library
and the check runs before any process starts:

- ``manifest.json``: the size and SHA-256 of every file of the checkpoint, written last
  before the checkpoint is renamed into place. :func:`verify_checkpoint` re-hashes the
  files, so a truncated, zeroed or bit-flipped shard, a deleted file or a bad
  ``actor_state.json`` is found before anything is loaded;
- ``latest``: a plain name of a directory next to it. :func:`read_latest` refuses an
  empty pointer, one naming a missing directory, and one that leads outside the
  checkpoint folder (``../other_run/...``, an absolute path, a symlink out), so a run
  never resumes from, nor truncates its metrics to, another run's checkpoint;
- :func:`choose_checkpoint`: ``latest``, else (if it or the checkpoint it names is
  broken) the newest complete older one, with the reason each skipped one was skipped.

Checkpoints are trusted input: the manifest detects corruption, not an attacker who can
rewrite it (megatron's ``common.pt`` and torch DCP's ``.metadata`` are unpickled on load).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_rl.storage.durable import write_text_durable

__all__ = [
    "LATEST_FILE",
    "MANIFEST_FILE",
    "STATE_FILE",
    "BASE_WEIGHTS_KEY",
    "CheckpointError",
    "base_weights_of",
    "base_reference",
    "verify_base_weights",
    "weights_fingerprint",
    "ResumeChoice",
    "checkpoint_step",
    "choose_checkpoint",
    "file_digest",
    "prune_checkpoints",
    "read_latest",
    "verify_checkpoint",
    "write_latest",
    "write_manifest",
]

LATEST_FILE = "latest"
"""``<checkpoints>/latest``: the name of the newest checkpoint directory beside it."""
MANIFEST_FILE = "manifest.json"
"""Size and SHA-256 of every other file of a checkpoint (written last)."""
STATE_FILE = "actor_state.json"
"""Counters, LR schedule, layout and the driver's state (step, data cursor) of a checkpoint."""
BASE_WEIGHTS_KEY = "base_weights"
"""``actor_state.json``'s entry of an adapter-only LoRA checkpoint: ``{"path", "fingerprint"}``
of the frozen base weights it was trained over (which it does not hold)."""

_STEP_DIR = re.compile(r"^step_(\d+)$")
_MANIFEST_FORMAT = "megatron_rl.manifest/1"
_MAX_POINTER_BYTES = 4096


class CheckpointError(ValueError):
    """A checkpoint (or ``latest`` pointer) that cannot be used; ``path`` and ``reason`` say why."""

    def __init__(self, path: str | os.PathLike, reason: str):
        self.path, self.reason = Path(path), reason
        super().__init__(f"{path}: {reason}")


def file_digest(path: str | os.PathLike) -> str:
    """SHA-256 of a file's bytes, hex."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# --------------------------------------------------------------------------- the manifest


def checkpoint_files(directory: str | os.PathLike) -> list[str]:
    """Every file under ``directory`` except the manifest, as sorted POSIX relative paths."""
    root = Path(directory)
    return sorted(
        p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and p.name != MANIFEST_FILE
    )  # fmt: skip


def write_manifest(directory: str | os.PathLike, digests: Mapping[str, str]) -> None:
    """Write ``manifest.json`` for the files ``digests`` names (``{relative path: sha256}``)."""
    root = Path(directory)
    files = {name: {"size": (root / name).stat().st_size, "sha256": digests[name]} for name in sorted(digests)}
    write_text_durable(root / MANIFEST_FILE, json.dumps({"format": _MANIFEST_FORMAT, "files": files}, indent=1) + "\n")


def _check_manifest(root: Path) -> None:
    try:
        manifest = json.loads((root / MANIFEST_FILE).read_text(encoding="utf-8"))
        files = manifest["files"]
        if manifest.get("format") != _MANIFEST_FORMAT or not isinstance(files, dict):
            raise ValueError("unknown format")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(root, f"{MANIFEST_FILE} is unreadable ({type(e).__name__}: {e})") from None
    for name, entry in files.items():
        path = root / name
        if ".." in Path(name).parts or not path.is_file():
            raise CheckpointError(root, f"{name} is missing")
        size = path.stat().st_size
        if size != entry.get("size"):
            raise CheckpointError(root, f"{name} has {size} bytes, the manifest says {entry.get('size')} (truncated?)")
        if file_digest(path) != entry.get("sha256"):
            raise CheckpointError(root, f"{name} does not match its SHA-256 in the manifest (corrupted)")


# --------------------------------------------------------------------------- checking one checkpoint


def _read_state(root: Path) -> dict[str, Any]:
    try:
        record = json.loads((root / STATE_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(root, f"{STATE_FILE} is missing") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(root, f"{STATE_FILE} is unreadable ({type(e).__name__}: {e})") from None
    trainer = record.get("trainer") if isinstance(record, dict) else None
    if not isinstance(trainer, dict):
        raise CheckpointError(root, f"{STATE_FILE} holds no trainer state (not written by the trainer)")
    step, sampler = trainer.get("step"), trainer.get("sampler")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0 or not isinstance(sampler, dict):
        raise CheckpointError(root, f"{STATE_FILE} has a malformed trainer state: step {step!r}, sampler {sampler!r}")
    return record


def verify_checkpoint(directory: str | os.PathLike) -> dict[str, Any]:
    """Check that a training checkpoint is complete and intact; returns its ``actor_state.json``.

    Raises :class:`CheckpointError` saying what is wrong. With a manifest every file is
    re-hashed; a checkpoint from before manifests existed gets the structural checks only.
    """
    root = Path(directory)
    if not root.is_dir():
        raise CheckpointError(root, "is not a directory")
    record = _read_state(root)
    if (root / MANIFEST_FILE).is_file():
        _check_manifest(root)
    for name in ("metadata.json", ".metadata", "common.pt"):
        path = root / name
        if not path.is_file() or path.stat().st_size == 0:
            raise CheckpointError(root, f"{name} is missing or empty")
    try:
        json.loads((root / "metadata.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(root, f"metadata.json is unreadable ({type(e).__name__}: {e})") from None
    if not any(root.glob("*.distcp")):
        raise CheckpointError(root, "holds no tensor files (*.distcp)")
    return record


# --------------------------------------------------------------------------- the base of an adapter-only checkpoint

_SAMPLE_BYTES = 1 << 20


def weights_fingerprint(directory: str | os.PathLike) -> str:
    """A cheap identity of a weights directory (HF safetensors or a Megatron checkpoint), hex.

    SHA-256 over the manifest where one exists (it holds every file's SHA-256); else over
    ``config.json``, DCP's ``.metadata`` and each weight file's name, size and, for
    safetensors files, their first and last MiB (the header names every tensor's place; a
    Megatron checkpoint's ``.distcp`` files can number tens of thousands: name and size).
    Tells two different models or fine-tunes apart without reading the weights whole."""
    root = Path(directory)
    digest = hashlib.sha256()
    if (root / MANIFEST_FILE).is_file():
        digest.update((root / MANIFEST_FILE).read_bytes())
        return digest.hexdigest()
    for path in sorted(p for p in root.iterdir() if p.is_file()):
        if path.name in ("config.json", ".metadata"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
        elif path.suffix in (".safetensors", ".distcp"):
            size = path.stat().st_size
            digest.update(f"{path.name}\0{size}".encode())
            if path.suffix == ".safetensors":
                with open(path, "rb") as f:
                    digest.update(f.read(_SAMPLE_BYTES))
                    f.seek(max(0, size - _SAMPLE_BYTES))
                    digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()


def base_weights_of(directory: str | os.PathLike) -> dict[str, str] | None:
    """The base weights an adapter-only LoRA checkpoint records (``{"path", "fingerprint"}``);
    None for any other weights directory."""
    path = Path(directory) / STATE_FILE
    if not path.is_file():
        return None
    try:
        base = json.loads(path.read_text(encoding="utf-8")).get(BASE_WEIGHTS_KEY)
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as e:
        raise CheckpointError(directory, f"{STATE_FILE} is unreadable ({type(e).__name__}: {e})") from None
    if base is not None and not (isinstance(base, dict) and isinstance(base.get("path"), str)
                                 and isinstance(base.get("fingerprint"), str)):  # fmt: skip
        raise CheckpointError(directory, f"{STATE_FILE} has a malformed {BASE_WEIGHTS_KEY!r}: {base!r}")
    return base


def verify_base_weights(directory: str | os.PathLike) -> dict[str, str] | None:
    """:func:`base_weights_of`, checked: the base an adapter-only checkpoint names is still
    where it says, with the fingerprint it records (else :class:`CheckpointError` saying which)."""
    base = base_weights_of(directory)
    if base is None:
        return None
    here = Path(base["path"])
    if not here.is_dir():
        raise CheckpointError(directory, f"holds LoRA adapters only; their base weights, {here} (its {STATE_FILE}), "
                                         "are gone")  # fmt: skip
    if weights_fingerprint(here) != base["fingerprint"]:
        raise CheckpointError(directory, f"holds LoRA adapters only, trained over other weights than those now in "
                                         f"{here} (the fingerprint its {STATE_FILE} records differs)")  # fmt: skip
    return base


def base_reference(source: str | os.PathLike) -> dict[str, str]:
    """``{"path", "fingerprint"}`` of the base weights that loading ``source`` puts in a LoRA
    model: ``source`` itself (absolute), or the base an adapter-only checkpoint records."""
    recorded = base_weights_of(source)
    if recorded is not None:
        return recorded
    path = Path(source).absolute()
    return {"path": str(path), "fingerprint": weights_fingerprint(path)}


# --------------------------------------------------------------------------- the latest pointer


def write_latest(checkpoint_dir: str | os.PathLike, name: str) -> None:
    """Point ``checkpoint_dir/latest`` at the checkpoint ``name`` beside it (durably)."""
    write_text_durable(Path(checkpoint_dir) / LATEST_FILE, name + "\n")


def _inside(path: Path, folder: Path) -> bool:
    return path.resolve().parent == folder.resolve()


def read_latest(checkpoint_dir: str | os.PathLike) -> Path | None:
    """The checkpoint ``checkpoint_dir/latest`` names, or ``None`` without a pointer.

    Raises :class:`CheckpointError` for a pointer that is empty or unreadable, names a
    missing directory, or leads outside ``checkpoint_dir``: never followed.
    """
    folder = Path(checkpoint_dir)
    pointer = folder / LATEST_FILE
    if not pointer.exists():
        return None
    try:
        with open(pointer, "rb") as f:
            name = f.read(_MAX_POINTER_BYTES).decode("utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(pointer, f"is unreadable ({type(e).__name__}: {e})") from None
    if not name:
        raise CheckpointError(pointer, "is empty")
    target = folder / name
    if Path(name).is_absolute() or Path(name).name != name or name in (".", "..") or not _inside(target, folder):
        raise CheckpointError(pointer, f"names {name!r}, outside {folder}; not followed")
    if not target.is_dir():
        raise CheckpointError(pointer, f"names {name!r}, which does not exist")
    return target


def checkpoint_step(path: Path) -> int | None:
    """The step of a ``step_NNNNNN`` directory name (``None`` for any other name)."""
    match = _STEP_DIR.match(path.name)
    return int(match.group(1)) if match else None


# --------------------------------------------------------------------------- choosing one to resume from


@dataclass
class ResumeChoice:
    """The checkpoint to resume from, and the broken ones passed over on the way."""

    path: Path | None
    """The newest complete checkpoint (``None``: there is none, start fresh)."""
    record: dict[str, Any] | None = None
    """Its ``actor_state.json`` (the driver's state under ``"trainer"``)."""
    skipped: list[CheckpointError] = field(default_factory=list)
    """Why each newer checkpoint (or the ``latest`` pointer) was not used."""


def _step_dirs(folder: Path) -> list[Path]:
    dirs = [p for p in folder.iterdir() if checkpoint_step(p) is not None and p.is_dir()] if folder.is_dir() else []
    return sorted(dirs, key=checkpoint_step, reverse=True)


def choose_checkpoint(checkpoint_dir: str | os.PathLike) -> ResumeChoice:
    """The checkpoint of ``checkpoint_dir`` to resume from: the one ``latest`` names if it is
    intact, else the newest intact ``step_N`` older than it (or than any, when the pointer
    itself is bad or missing). Raises :class:`CheckpointError` when checkpoints exist but
    none is intact (starting over would silently discard them)."""
    folder = Path(checkpoint_dir)
    skipped: list[CheckpointError] = []
    try:
        latest = read_latest(folder)
    except CheckpointError as e:
        skipped.append(e)
        latest = None
    steps = _step_dirs(folder)
    if latest is None and steps and not skipped:
        skipped.append(CheckpointError(folder / LATEST_FILE, "is missing (a crash before it was written?)"))
    if latest is not None:
        newest = checkpoint_step(latest)
        older = [p for p in steps if newest is not None and checkpoint_step(p) < newest]
        candidates: Iterable[Path] = [latest, *older]
    else:
        candidates = steps
    for path in candidates:
        if not _inside(path, folder):
            skipped.append(CheckpointError(path, f"leads outside {folder}; not followed"))
            continue
        try:
            return ResumeChoice(path=path, record=verify_checkpoint(path), skipped=skipped)
        except CheckpointError as e:
            skipped.append(e)
    if skipped:
        reasons = "; ".join(str(e) for e in skipped)
        raise CheckpointError(folder, f"holds no intact checkpoint to resume from ({reasons})")
    return ResumeChoice(path=None)


def prune_checkpoints(checkpoint_dir: str | os.PathLike, *, keep_last: int, keep_every_steps: int = 0) -> list[Path]:
    """Delete the ``step_N`` checkpoints of ``checkpoint_dir`` beyond the ``keep_last`` newest,
    except those whose step is a multiple of ``keep_every_steps`` and the one ``latest``
    names; ``keep_last`` 0 keeps all. Each is renamed out of the ``step_N`` pattern first,
    so a crash mid-delete leaves nothing a resume would consider. Returns the deleted paths."""
    folder = Path(checkpoint_dir)
    if keep_last <= 0:
        return []
    try:
        latest = read_latest(folder)
    except CheckpointError:
        latest = None  # a bad pointer: the resume falls back to the newest intact ones, kept below
    deleted = []
    for path in _step_dirs(folder)[keep_last:]:
        step = checkpoint_step(path)
        if (keep_every_steps and step % keep_every_steps == 0) or (latest is not None and path.name == latest.name):
            continue
        doomed = path.with_name(f".deleting_{path.name}")
        os.rename(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        deleted.append(path)
    return deleted
