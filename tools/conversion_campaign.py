"""The 26 bad conversions of the reliability campaign (``tools/reliability_campaign.py``).

Each case runs ``python -m megatron_rl convert ...`` on a damaged copy of a tiny random
Qwen2 model (or of its Megatron conversion) and is ``handled`` when the command exits 1
(2 for a bad flag) with an ``error:`` line and no traceback, and leaves no output behind;
a model without tokenizer files must convert with one ``warning:`` line. Two cases fill a
small tmpfs (root only; skipped elsewhere): one too small from the start, one sized just
above the output so that the disk fills up while writing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

VOCAB = 250


def _tiny_hf(directory: Path, *, tokenizer: bool = True) -> Path:
    import torch
    import transformers

    config = transformers.Qwen2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128)  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory, max_shard_size="200KB")
    if tokenizer:
        from megatron_rl.tasks.toy import save_toy_tokenizer

        save_toy_tokenizer(directory)
    return directory


def _edit_config(directory: Path, **changes) -> None:
    cfg = json.loads((directory / "config.json").read_text())
    cfg.update(changes)
    (directory / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))


def _first_shard(directory: Path) -> Path:
    return sorted(directory.glob("*.safetensors"))[0]


def _mount_tmpfs(path: Path, size_bytes: int) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0  # fmt: skip


def campaign_conversions(out: Path, record: Callable[..., None], run: Callable[..., tuple[int, str]]) -> None:
    work = out / "convert"
    good_hf = _tiny_hf(work / "good_hf")
    bare_hf = _tiny_hf(work / "bare_hf", tokenizer=False)
    good_mcore = work / "good_mcore"
    code, text = run(["convert", "hf-to-mcore", "--hf", str(good_hf), "--out", str(good_mcore)])
    assert code == 0, text
    size = sum(p.stat().st_size for p in good_hf.glob("*.safetensors"))

    def hf_copy(name: str, damage: Callable[[Path], object]) -> Path:
        copy = work / name
        shutil.copytree(good_hf, copy)
        damage(copy)
        return copy

    def mcore_copy(name: str, damage: Callable[[Path], object]) -> Path:
        copy = work / name
        shutil.copytree(good_mcore, copy)
        damage(copy)
        return copy

    (work / "a_file").write_text("x")
    (work / "full_out").mkdir(exist_ok=True)
    (work / "full_out" / "keep.txt").write_text("user data")
    (work / "empty_hf").mkdir(exist_ok=True)
    h2m = ["convert", "hf-to-mcore", "--hf"]
    m2h = ["convert", "mcore-to-hf", "--mcore"]
    cases: list[tuple[str, list[str], int]] = [
        ("hf_missing", [*h2m, str(work / "nope")], 1),
        ("hf_is_a_file", [*h2m, str(work / "a_file")], 1),
        ("hf_empty_dir", [*h2m, str(work / "empty_hf")], 1),
        ("config_invalid_json", [*h2m, str(hf_copy("c1", lambda d: (d / "config.json").write_text("{oops")))], 1),
        ("model_type_unsupported", [*h2m, str(hf_copy("c2", lambda d: _edit_config(d, model_type="gpt2")))], 1),
        ("config_missing_hidden_size", [*h2m, str(hf_copy("c3", lambda d: _edit_config(d, hidden_size=None)))], 1),
        ("shard_missing", [*h2m, str(hf_copy("c4", lambda d: _first_shard(d).unlink()))], 1),
        ("shard_truncated", [*h2m, str(hf_copy("c5", lambda d: os.truncate(_first_shard(d), 100)))], 1),
        ("shard_header_garbage", [*h2m, str(hf_copy("c6", lambda d: _first_shard(d).write_bytes(b"\xff" * 64)))], 1),
        ("shape_mismatch", [*h2m, str(hf_copy("c7", lambda d: _edit_config(d, intermediate_size=80)))], 1),
        ("vocab_mismatch", [*h2m, str(hf_copy("c8", lambda d: _edit_config(d, vocab_size=300)))], 1),
        ("layers_mismatch", [*h2m, str(hf_copy("c9", lambda d: _edit_config(d, num_hidden_layers=1)))], 1),
        ("out_not_empty", [*h2m, str(good_hf), "--out", str(work / "full_out")], 1),
        ("out_is_a_file", [*h2m, str(good_hf), "--out", str(work / "a_file")], 1),
        ("out_unwritable", [*h2m, str(good_hf), "--out", "/proc/megatron_rl_convert"], 1),
        ("tp_not_dividing", [*h2m, str(good_hf), "--tp", "3"], 1),
        ("pp_not_dividing", [*h2m, str(good_hf), "--pp", "3"], 1),
        ("bad_dtype_flag", [*h2m, str(good_hf), "--dtype", "int8"], 2),
        ("mcore_missing", [*m2h, str(work / "no_mcore")], 1),
        ("mcore_metadata_json_missing", [*m2h, str(mcore_copy("m1", lambda d: (d / "metadata.json").unlink()))], 1),
        ("mcore_dcp_metadata_corrupt", [*m2h, str(mcore_copy("m2", lambda d: (d / ".metadata").write_bytes(b"x")))], 1),
        ("mcore_without_hf_config", [*m2h, str(mcore_copy("m3", lambda d: shutil.rmtree(d / "hf_config")))], 1),
        ("mcore_bad_shard_size_flag", [*m2h, str(good_mcore), "--max-shard-size", "0"], 2),
    ]
    for name, args, expect in cases:
        if "--out" not in args:
            args = [*args, "--out", str(work / f"out_{name}")]
        out_dir = Path(args[args.index("--out") + 1])
        before = sorted(p.name for p in out_dir.iterdir()) if out_dir.is_dir() else None
        code, text = run(args, timeout=300)
        after = sorted(p.name for p in out_dir.iterdir()) if out_dir.is_dir() else None
        clean = after == before and not list(out_dir.parent.glob(f".{out_dir.name}.tmp-*"))
        ok = code == expect and "error:" in text and "Traceback" not in text and clean
        record("conversions", name, "handled" if ok else ("accepted" if code == 0 else "crashed"), exit=code,
               message=next((x for x in text.splitlines() if x.startswith("error:")), text[-200:])[:300])  # fmt: skip

    code, text = run(["convert", "hf-to-mcore", "--hf", str(bare_hf), "--out", str(work / "out_bare")])
    ok = code == 0 and "warning:" in text and "no tokenizer files" in text
    record("conversions", "no_tokenizer_files", "handled" if ok else "accepted", exit=code)

    for name, fs_size in (("disk_too_small", size // 2), ("disk_fills_while_writing", size + 64 * 1024)):
        mount = work / f"fs_{name}"
        if not _mount_tmpfs(mount, fs_size):
            record("conversions", name, "skipped", reason="cannot mount a tmpfs (not root)")
            continue
        try:
            code, text = run(["convert", "hf-to-mcore", "--hf", str(good_hf), "--out", str(mount / "out")])
            leftovers = sorted(p.name for p in mount.iterdir())
            ok = code == 1 and ("no space left" in text or "not enough space" in text) and "Traceback" not in text
            record("conversions", name, "handled" if ok and not leftovers else "crashed", exit=code,
                   leftovers=leftovers, message=next((x for x in text.splitlines() if x.startswith("error:")), "")[:300])  # fmt: skip
        finally:
            subprocess.run(["umount", str(mount)], capture_output=True)
