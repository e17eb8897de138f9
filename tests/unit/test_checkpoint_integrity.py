"""Checkpoints as files (``megatron_rl/storage/checkpoints.py``): the manifest, the ``latest``
pointer, and the fallback past broken checkpoints, on small stand-in checkpoints.

A stand-in has the files of a real one (``actor_state.json`` with a trainer state,
``metadata.json``, ``.metadata``, ``common.pt``, a shard, an RNG file, the manifest), so
every corruption of the issue is tried here in milliseconds; ``tests/e2e/test_reliability.py``
repeats them on a real checkpoint and resumes from one for real.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from megatron_rl.storage.checkpoints import (
    CheckpointError,
    choose_checkpoint,
    read_latest,
    verify_checkpoint,
    write_latest,
)
from tests.helpers.checkpoints import make_checkpoint


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    folder = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        make_checkpoint(folder, step)
    return folder


def _flip_a_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


# Every corruption of the issue (and a few more), applied to the latest checkpoint step_000003.
CORRUPTIONS = {
    "truncated_shard": lambda p: os.truncate(p / "__0_0.distcp", 100),
    "zeroed_shard": lambda p: (p / "__0_0.distcp").write_bytes(bytes((p / "__0_0.distcp").stat().st_size)),
    "bit_flipped_shard": lambda p: _flip_a_bit(p / "__0_0.distcp"),
    "deleted_shard": lambda p: (p / "__0_0.distcp").unlink(),
    "deleted_dcp_metadata": lambda p: (p / ".metadata").unlink(),
    "deleted_metadata_json": lambda p: (p / "metadata.json").unlink(),
    "truncated_common": lambda p: os.truncate(p / "common.pt", 3),
    "truncated_rng": lambda p: os.truncate(p / "rng" / "rank0.pt", 5),
    "bad_actor_state_json": lambda p: (p / "actor_state.json").write_text("{not json"),
    "actor_state_without_trainer": lambda p: (p / "actor_state.json").write_text('{"layout": {}}'),
    "deleted_manifest_entry_file": lambda p: (p / "rng" / "rank0.pt").unlink(),
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_a_corrupted_latest_falls_back_to_the_previous_checkpoint(folder, kind):
    CORRUPTIONS[kind](folder / "step_000003")
    choice = choose_checkpoint(folder)
    assert choice.path.name == "step_000002"
    assert choice.record["trainer"]["step"] == 2
    assert [e.path.name for e in choice.skipped] == ["step_000003"]  # the warning names the broken one


@pytest.mark.parametrize(
    "pointer, reason",
    [("", "is empty"), ("step_000009", "does not exist"), ("../elsewhere", "outside"), ("/tmp", "outside")],
    ids=["empty", "dangling", "relative_outside", "absolute"],
)
def test_a_bad_latest_pointer_is_not_followed(folder, pointer, reason):
    (folder / "latest").write_text(pointer)
    with pytest.raises(CheckpointError, match=reason):
        read_latest(folder)
    choice = choose_checkpoint(folder)
    assert choice.path.name == "step_000003"  # the newest intact one
    assert reason in str(choice.skipped[0])


def test_a_symlink_leading_outside_is_not_followed(folder, tmp_path):
    other = make_checkpoint(tmp_path / "other_run", 7)
    (folder / "step_000007").symlink_to(other, target_is_directory=True)
    write_latest(folder, "step_000007")
    with pytest.raises(CheckpointError, match="outside"):
        read_latest(folder)
    assert choose_checkpoint(folder).path.name == "step_000003"


def test_a_missing_pointer_uses_the_newest_intact_checkpoint(folder):
    (folder / "latest").unlink()
    choice = choose_checkpoint(folder)
    assert choice.path.name == "step_000003" and "missing" in str(choice.skipped[0])


def test_newer_checkpoints_than_latest_are_not_used(folder):
    write_latest(folder, "step_000002")
    assert choose_checkpoint(folder).path.name == "step_000002"


def test_no_checkpoints_is_a_fresh_start_and_all_broken_is_an_error(tmp_path, folder):
    assert choose_checkpoint(tmp_path / "none").path is None
    for step in (1, 2, 3):
        os.truncate(folder / f"step_{step:06d}" / "__0_0.distcp", 1)
    with pytest.raises(CheckpointError, match="no intact checkpoint") as err:
        choose_checkpoint(folder)
    assert "step_000001" in str(err.value) and "step_000003" in str(err.value)


def test_checkpoints_without_a_manifest_get_the_structural_checks(tmp_path):
    path = make_checkpoint(tmp_path, 4, manifest=False)
    assert verify_checkpoint(path)["trainer"]["step"] == 4
    os.truncate(path / "common.pt", 0)
    with pytest.raises(CheckpointError, match="common.pt"):
        verify_checkpoint(path)


def test_durable_writes_leave_no_temporary_files(folder):
    write_latest(folder, "step_000001")
    assert (folder / "latest").read_text() == "step_000001\n"
    assert sorted(p.name for p in folder.iterdir()) == ["latest", "step_000001", "step_000002", "step_000003"]


# --------------------------------------------------------------------------- the base of an adapter-only checkpoint


def test_the_weights_fingerprint_tells_files_apart_and_follows_adapter_only_checkpoints(tmp_path, folder):
    from megatron_rl.storage.checkpoints import base_reference, base_weights_of, weights_fingerprint

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "qwen2"}')
    (hf / "model.safetensors").write_bytes(bytes(range(256)) * 20_000)  # 5 MiB: first and last MiB read
    first = weights_fingerprint(hf)
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in hf.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    assert weights_fingerprint(copy) == first  # a copy of the same files
    _flip_a_bit(hf / "model.safetensors")  # the middle: outside the sampled bytes
    assert weights_fingerprint(hf) == first
    data = bytearray((hf / "model.safetensors").read_bytes())
    data[-1] ^= 1
    (hf / "model.safetensors").write_bytes(bytes(data))
    assert weights_fingerprint(hf) != first
    (copy / "config.json").write_text('{"model_type": "qwen3"}')
    assert weights_fingerprint(copy) != first
    # A checkpoint with a manifest: its digest (every file's SHA-256).
    step = folder / "step_000001"
    before = weights_fingerprint(step)
    _flip_a_bit(step / "__0_0.distcp")
    assert weights_fingerprint(step) == before  # the manifest is what is read; verify_checkpoint finds the flip
    # base_reference: the directory itself, or the base an adapter-only checkpoint names.
    assert base_reference(copy) == {"path": str(copy.absolute()), "fingerprint": weights_fingerprint(copy)}
    assert base_weights_of(copy) is None and base_weights_of(step) is None
    lora = make_checkpoint(tmp_path / "lora", 5, base_weights={"path": str(copy), "fingerprint": "cd" * 32})
    assert base_reference(lora) == base_weights_of(lora) == {"path": str(copy), "fingerprint": "cd" * 32}
    bad = make_checkpoint(tmp_path / "bad", 5, base_weights={"path": 3})
    with pytest.raises(CheckpointError, match="malformed 'base_weights'"):
        base_weights_of(bad)
