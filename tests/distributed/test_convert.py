"""HF <-> Megatron checkpoint conversion (megatron_rl.models.convert.hf_mcore, megatron-rl convert).

* HF -> Megatron (TP, PP in {1, 2}) -> HF is bit-exact for every tensor, for Qwen2
  (GQA + untied, MHA + tied), Qwen3 (qk-norm, head_dim != H/nh) and Llama; config,
  generation config and tokenizer files survive; the result loads with
  ``AutoModelForCausalLM.from_pretrained`` and gives the source model's logits.
* GPTModel built from the adapters at TP/PP in {1, 2} x {1, 2} and loaded with
  ``dist_checkpointing.load`` from a converted checkpoint gives the transformers logits
  (fp32, <= 1e-4); one job of 4 forked gloo ranks runs every check.
* Each kind of bad input raises ConversionError naming the file / tensor and leaves no
  output (not even a partial one) behind.
"""

from __future__ import annotations

import errno
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from megatron_rl.cli import convert
from megatron_rl.models.convert.hf_mcore import (
    RECORD_FILE,
    ConversionError,
    HfToMcoreOptions,
    McoreToHfOptions,
    hf_to_mcore,
    mcore_to_hf,
)
from tests.helpers.actor_job import FORK_RANKS
from tests.helpers.jobs import run_job
from tests.helpers.tiny_hf import VARIANTS, VOCAB, build_model, save_model, save_tokenizer

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "helpers" / "mcore_forward_worker.py"
PARALLEL = [(1, 1), (2, 1), (1, 2), (2, 2)]


def _hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    dirs = {variant: save_model(variant, root / variant, seed=i) for i, variant in enumerate(VARIANTS)}
    save_tokenizer(dirs["qwen2_gqa"])
    return dirs


@pytest.fixture(scope="module")
def mcore_dirs(hf_dirs, tmp_path_factory) -> dict[tuple[str, int, int], Path]:
    root = tmp_path_factory.mktemp("mcore")
    out = {}
    for variant, hf_dir in hf_dirs.items():
        for tp, pp in PARALLEL:
            out[variant, tp, pp] = root / f"{variant}_tp{tp}_pp{pp}"
            hf_to_mcore(HfToMcoreOptions(hf_dir=hf_dir, out_dir=out[variant, tp, pp], tp=tp, pp=pp))
    # Stored without padding (250 rows): loading at TP=2 (256 rows) exercises allow_shape_mismatch.
    out["qwen3_unpadded"] = root / "qwen3_unpadded"
    hf_to_mcore(
        HfToMcoreOptions(hf_dir=hf_dirs["qwen3"], out_dir=out["qwen3_unpadded"], make_vocab_size_divisible_by=1)
    )
    return out


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("tp,pp", PARALLEL)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_round_trip_is_bit_exact(variant, tp, pp, hf_dirs, mcore_dirs, tmp_path):
    mcore_dir = mcore_dirs[variant, tp, pp]
    record = json.loads((mcore_dir / RECORD_FILE).read_text())
    assert record["padded_vocab_size"] == 256 and record["vocab_size"] == VOCAB
    assert (mcore_dir / "hf_config" / "config.json").is_file()

    out = tmp_path / "hf"
    summary = mcore_to_hf(McoreToHfOptions(mcore_dir=mcore_dir, out_dir=out, max_shard_bytes=64 * 1024))
    source, result = _hf_tensors(hf_dirs[variant]), _hf_tensors(out)
    assert sorted(result) == sorted(source)
    for name, tensor in source.items():
        assert result[name].dtype == tensor.dtype and torch.equal(result[name], tensor), name
    assert summary.num_tensors == len(source)

    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(source) and len(set(index["weight_map"].values())) > 1
    for name in ("config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (hf_dirs[variant] / name).read_bytes()
    if variant == "qwen2_gqa":
        assert (out / "tokenizer.json").read_bytes() == (hf_dirs[variant] / "tokenizer.json").read_bytes()


def test_export_loads_in_transformers_with_same_logits(hf_dirs, mcore_dirs, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "hf"
    assert convert.main(["mcore-to-hf", "--mcore", str(mcore_dirs["qwen2_gqa", 2, 2]), "--out", str(out)]) == 0
    assert (out / "model.safetensors").is_file()  # default 5GB limit: one shard, HF naming
    tokens = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    reference = build_model("qwen2_gqa", seed=0)
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, reference(tokens).logits)
    assert AutoTokenizer.from_pretrained(out).convert_tokens_to_ids("w7") == 7


def test_dtype_cast_on_export(mcore_dirs, tmp_path):
    out = tmp_path / "bf16"
    mcore_to_hf(McoreToHfOptions(mcore_dir=mcore_dirs["llama", 1, 1], out_dir=out, dtype="bf16"))
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_tensor("lm_head.weight").dtype == torch.bfloat16
    cfg = json.loads((out / "config.json").read_text())
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16"


def test_dist_checkpoint_keys_match_gpt_model(mcore_dirs):
    """The stored keys and global shapes are the GPTModel sharded_state_dict ones (see the worker for loading)."""
    from megatron_rl.models.convert.mcore_io import DistCheckpointReader

    reader = DistCheckpointReader(mcore_dirs["qwen3", 2, 1])
    assert reader.tensors["decoder.layers.self_attention.linear_qkv.weight"][0] == (2, (4 + 2 * 2) * 32, 64)
    assert reader.tensors["decoder.layers.mlp.linear_fc1.weight"][0] == (2, 2 * 96, 64)
    assert reader.tensors["decoder.layers.self_attention.q_layernorm.weight"][0] == (2, 32)
    assert reader.tensors["embedding.word_embeddings.weight"][0] == (256, 64)
    assert "output_layer.weight" not in DistCheckpointReader(mcore_dirs["qwen2_tied", 1, 1]).tensors


# ----------------------------------------------------------------------------- Megatron forward


def test_megatron_logits_match_transformers(hf_dirs, mcore_dirs, tmp_path):
    jobs = [
        {
            "name": variant,
            "hf_dir": str(hf_dirs[variant]),
            "mcore_dir": str(mcore_dirs[variant, 2, 2]),
            "tp": tp,
            "pp": pp,
        }
        for variant in VARIANTS
        for tp, pp in PARALLEL
    ]
    jobs += [
        {
            "name": "qwen3_unpadded",
            "hf_dir": str(hf_dirs["qwen3"]),
            "mcore_dir": str(mcore_dirs["qwen3_unpadded"]),
            "tp": tp,
            "pp": 1,
        }
        for tp in (1, 2)
    ]
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    cmd = [sys.executable, str(FORK_RANKS), "4", str(WORKER), str(tmp_path / "jobs.json"), str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = run_job(cmd, cwd=REPO, env=env, timeout_s=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]

    reports = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    assert len(reports) == 4
    assert all(r["shim_first_apply"] and not r["shim_second_apply"] for r in reports)
    seen = set()
    for report in reports:
        for job in report["jobs"]:
            key = (job["name"], job["tp"], job["pp"])
            seen.add(key)
            assert job["max_abs_hf"] > 0.1, key  # logits are not trivially small
            assert job["max_abs_diff"] <= 1e-4, (key, job)
            assert job["max_abs_padding"] == 0.0, (key, job)
    assert seen == {(j["name"], j["tp"], j["pp"]) for j in jobs}
    worst = max(job["max_abs_diff"] for report in reports for job in report["jobs"])
    print(f"max |megatron - transformers| logit difference over {len(jobs)} TP/PP loads: {worst:.3g}")


# ----------------------------------------------------------------------------- bad input


def _rewrite(path: Path, edit) -> None:
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _assert_no_output(out: Path) -> None:
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.tmp-")]


@pytest.fixture
def hf_copy(hf_dirs, tmp_path) -> Path:
    """A sharded copy of the qwen2_gqa model that a test may damage."""
    return save_model("qwen2_gqa", tmp_path / "src", max_shard_size="100KB")


def _convert_error(hf_dir: Path, out: Path, **kwargs) -> str:
    with pytest.raises(ConversionError) as info:
        hf_to_mcore(HfToMcoreOptions(hf_dir=hf_dir, out_dir=out, **kwargs))
    _assert_no_output(out)
    return str(info.value)


def _shard_of(hf_dir: Path, name: str) -> Path:
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    return hf_dir / index["weight_map"][name]


def test_missing_shard(hf_copy, tmp_path):
    shard = _shard_of(hf_copy, "model.layers.1.mlp.up_proj.weight")
    shard.unlink()
    message = _convert_error(hf_copy, tmp_path / "out")
    assert shard.name in message and "missing" in message


def test_corrupt_shard(hf_copy, tmp_path):
    shard = _shard_of(hf_copy, "model.layers.0.self_attn.q_proj.weight")
    shard.write_bytes(shard.read_bytes()[:-100])
    message = _convert_error(hf_copy, tmp_path / "out")
    assert shard.name in message and "corrupt" in message


@pytest.mark.parametrize(
    "case,tensor",
    [
        ("missing", "model.layers.1.self_attn.k_proj.weight"),
        ("unexpected", "model.layers.0.mlp.extra_proj.weight"),
        ("shape", "model.layers.0.self_attn.o_proj.weight"),
    ],
)
def test_config_weights_mismatch(case, tensor, hf_copy, tmp_path):
    anchor = "model.layers.1.self_attn.k_proj.weight" if case == "missing" else "model.layers.0.self_attn.o_proj.weight"
    shard = _shard_of(hf_copy, anchor)

    def edit(tensors):
        if case == "missing":
            del tensors[tensor]
        elif case == "unexpected":
            tensors[tensor] = torch.zeros(3, 64)
        else:
            tensors[tensor] = torch.zeros(64, 60)

    _rewrite(shard, edit)
    if case == "missing":  # keep the index consistent, so the error is about the config, not the index
        index_path = hf_copy / "model.safetensors.index.json"
        index = json.loads(index_path.read_text())
        del index["weight_map"][tensor]
        index_path.write_text(json.dumps(index))
    message = _convert_error(hf_copy, tmp_path / "out")
    assert tensor in message and {"missing": "missing", "unexpected": "unexpected", "shape": "shape"}[case] in message
    if case != "missing":
        assert shard.name in message


def test_wrong_vocab_size(hf_copy, tmp_path):
    cfg = json.loads((hf_copy / "config.json").read_text())
    cfg["vocab_size"] = 300
    (hf_copy / "config.json").write_text(json.dumps(cfg))
    message = _convert_error(hf_copy, tmp_path / "out")
    assert "vocab size mismatch" in message and "model.embed_tokens.weight" in message and "300" in message


def test_non_empty_output_dir(hf_dirs, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    with pytest.raises(ConversionError, match="not empty"):
        hf_to_mcore(HfToMcoreOptions(hf_dir=hf_dirs["llama"], out_dir=out))
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp-")]


def test_failure_midway_leaves_no_partial_output(hf_dirs, tmp_path, monkeypatch):
    from megatron_rl.models.hf_io import SafetensorsReader

    calls = {"n": 0}
    original = SafetensorsReader.read

    def flaky_read(self, name):
        calls["n"] += 1
        if calls["n"] == 6:
            raise ConversionError(f"cannot read tensor '{name}' (injected)")
        return original(self, name)

    monkeypatch.setattr(SafetensorsReader, "read", flaky_read)
    out = tmp_path / "out"
    with pytest.raises(ConversionError, match="injected"):
        hf_to_mcore(HfToMcoreOptions(hf_dir=hf_dirs["qwen3"], out_dir=out))
    _assert_no_output(out)


def test_unsupported_model_type(hf_copy, tmp_path):
    cfg = json.loads((hf_copy / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (hf_copy / "config.json").write_text(json.dumps(cfg))
    message = _convert_error(hf_copy, tmp_path / "out")
    assert "gpt2" in message and "llama, qwen2, qwen3" in message


def test_parallel_sizes_checked(hf_dirs, tmp_path):
    message = _convert_error(hf_dirs["qwen2_gqa"], tmp_path / "out", tp=4)
    assert "num_key_value_heads=2" in message
    message = _convert_error(hf_dirs["qwen2_gqa"], tmp_path / "out", pp=4)
    assert "num_hidden_layers=2" in message


def test_mcore_missing_and_corrupt_files(mcore_dirs, tmp_path):
    import shutil

    from megatron_rl.models.convert.mcore_io import DistCheckpointReader

    src = tmp_path / "mc"
    shutil.copytree(mcore_dirs["qwen2_gqa", 1, 1], src)
    data_file = Path(DistCheckpointReader(src).files("decoder.layers.mlp.linear_fc1.weight")[-1])
    data = data_file.read_bytes()

    data_file.write_bytes(data[: len(data) // 2])  # truncated: header checks pass, reading fails
    with pytest.raises(ConversionError) as info:
        mcore_to_hf(McoreToHfOptions(mcore_dir=src, out_dir=tmp_path / "out"))
    assert data_file.name in str(info.value) and "cannot read tensor" in str(info.value)
    _assert_no_output(tmp_path / "out")

    data_file.unlink()
    with pytest.raises(ConversionError, match=f"{data_file.name} is missing"):
        mcore_to_hf(McoreToHfOptions(mcore_dir=src, out_dir=tmp_path / "out"))
    _assert_no_output(tmp_path / "out")

    with pytest.raises(ConversionError, match="no metadata.json"):
        mcore_to_hf(McoreToHfOptions(mcore_dir=tmp_path, out_dir=tmp_path / "out"))


def _config_dir(tmp_path: Path, source: Path, name: str, **changes) -> Path:
    directory = tmp_path / name
    directory.mkdir()
    cfg = json.loads((source / "config.json").read_text()) | changes
    (directory / "config.json").write_text(json.dumps(cfg))
    return directory


def test_mcore_config_mismatch(hf_dirs, mcore_dirs, tmp_path):
    # A tied config for an untied checkpoint: output_layer.weight is unexpected.
    tied = _config_dir(tmp_path, hf_dirs["qwen2_gqa"], "tied", tie_word_embeddings=True)
    with pytest.raises(ConversionError, match="unexpected tensor 'output_layer.weight'"):
        mcore_to_hf(
            McoreToHfOptions(mcore_dir=mcore_dirs["qwen2_gqa", 1, 1], out_dir=tmp_path / "a", hf_config_dir=tied)
        )
    # A Qwen3 config of the same size for a Qwen2 checkpoint: the q/k norms are missing.
    as_qwen3 = _config_dir(tmp_path, hf_dirs["qwen2_gqa"], "as_qwen3", model_type="qwen3", head_dim=16)
    with pytest.raises(ConversionError, match="missing tensor 'decoder.layers.self_attention.q_layernorm.weight'"):
        mcore_to_hf(
            McoreToHfOptions(mcore_dir=mcore_dirs["qwen2_gqa", 1, 1], out_dir=tmp_path / "b", hf_config_dir=as_qwen3)
        )
    # More vocabulary rows than the checkpoint stores.
    cfg_dir = _config_dir(tmp_path, hf_dirs["qwen3"], "big_vocab", vocab_size=300)
    with pytest.raises(ConversionError, match="vocab size mismatch"):
        mcore_to_hf(
            McoreToHfOptions(mcore_dir=mcore_dirs["qwen3", 1, 1], out_dir=tmp_path / "c", hf_config_dir=cfg_dir)
        )
    # A wrong MLP width: the shape error names the tensor and the file.
    wide = _config_dir(tmp_path, hf_dirs["llama"], "wide", intermediate_size=128)
    with pytest.raises(ConversionError, match=r"'decoder.layers.mlp.linear_fc1.weight' in .*__0_\d+.distcp has shape"):
        mcore_to_hf(McoreToHfOptions(mcore_dir=mcore_dirs["llama", 1, 1], out_dir=tmp_path / "d", hf_config_dir=wide))
    # A PEFT export of a checkpoint without adapters (they come with a LoRA run's checkpoints).
    with pytest.raises(ConversionError, match=r"--peft-out: checkpoint .* holds no LoRA adapters"):
        mcore_to_hf(McoreToHfOptions(mcore_dir=mcore_dirs["llama", 1, 1], out_dir=tmp_path / "e", peft_dir=tmp_path / "f"))
    for name in "abcdef":
        _assert_no_output(tmp_path / name)


def test_cli_reports_errors(tmp_path, capsys):
    assert convert.main(["hf-to-mcore", "--hf", str(tmp_path), "--out", str(tmp_path / "out")]) == 1
    assert "config.json" in capsys.readouterr().err


# ----------------------------------------------------------------------------- full disks, missing tokenizers


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_while_writing_is_a_clear_error_without_output(hf_dirs, mcore_dirs, tmp_path, monkeypatch):
    from megatron_rl.models.hf_io import SafetensorsReader, SafetensorsShardWriter

    # hf-to-mcore: the write fails inside torch DCP, which wraps the OSError.
    monkeypatch.setattr(SafetensorsReader, "read", _no_space)
    message = _convert_error(hf_dirs["llama"], tmp_path / "a")
    assert message.startswith(f"no space left on the device while writing {tmp_path / 'a'}") and "removed" in message
    # mcore-to-hf: the safetensors writer fails directly.
    monkeypatch.setattr(SafetensorsShardWriter, "write", _no_space)
    with pytest.raises(ConversionError, match="no space left on the device"):
        mcore_to_hf(McoreToHfOptions(mcore_dir=mcore_dirs["llama", 1, 1], out_dir=tmp_path / "b"))
    _assert_no_output(tmp_path / "b")


def test_too_little_free_space_is_refused_before_writing(hf_dirs, tmp_path, monkeypatch, capsys):
    import shutil

    from megatron_rl.models.convert import hf_mcore as convert_lib

    monkeypatch.setattr(convert_lib.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 10**12, 1000))
    assert convert.main(["hf-to-mcore", "--hf", str(hf_dirs["llama"]), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "error: not enough space for" in err and "has 1 KiB free" in err and "Traceback" not in err
    _assert_no_output(tmp_path / "out")


def test_a_model_without_tokenizer_files_converts_with_a_warning(hf_dirs, tmp_path, capsys):
    assert convert.main(["hf-to-mcore", "--hf", str(hf_dirs["llama"]), "--out", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    assert f"warning: {hf_dirs['llama']} has no tokenizer files" in err and "model.tokenizer" in err
    assert convert.main(["hf-to-mcore", "--hf", str(hf_dirs["qwen2_gqa"]), "--out", str(tmp_path / "b")]) == 0
    assert "warning" not in capsys.readouterr().err  # this one has its tokenizer
