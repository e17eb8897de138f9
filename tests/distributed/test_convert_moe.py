"""HF <-> Megatron conversion of mixture-of-experts models (Qwen3-MoE; ``megatron-rl convert --ep``).

* HF -> Megatron -> HF is bit-exact for the tiny MoE variants (``norm_topk_prob`` true and
  false, untied and tied) written at (TP, PP, EP) = (1, 1, 1), (2, 1, 2) and (2, 2, 4); the
  Megatron checkpoint does not depend on TP/PP/EP (its files are byte-identical).
* One 2-rank gloo job: the checkpoint loads with megatron's ``dist_checkpointing.load``
  (``strict="raise_all"``: every key the GPTModels ask for, no other) into a GPTModel built
  from the adapter at EP=2, at TP=2 (experts split along their width) and at TP=2 with
  expert TP 1 and EP=2 (each expert whole on one rank), and the logits match transformers
  within 1e-5 (float32). megatron's own ``dist_checkpointing.save`` of
  the EP=2 model writes the same keys, global shapes, dtypes and ``_extra_state`` objects as
  the converter; that checkpoint loads at EP=1 (resharded) with the same logits, and
  converts back to the HF tensors bit-exactly.
* ``--ep`` that does not divide the experts, is below 1, or is given for a dense model, and
  ``--etp`` that does not divide the expert width or is given for a dense model, are a
  one-line error naming the flag; a config whose expert count disagrees with the checkpoint
  names the tensor.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.cli import convert
from megatron_rl.models.convert.hf_mcore import (
    RECORD_FILE,
    ConversionError,
    HfToMcoreOptions,
    McoreToHfOptions,
    hf_to_mcore,
    mcore_to_hf,
)
from tests.dist_utils import run_on_ranks
from tests.helpers.tiny_hf import MOE_VARIANTS, VOCAB, save_model, save_tokenizer

LAYOUTS = [(1, 1, 1), (2, 1, 2), (2, 2, 4)]
"""(tp, pp, ep) the checkpoints are written for; the tiny models have 4 experts and 2 layers."""
BATCH, SEQ = 2, 12
FC1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
FC2 = "decoder.layers.mlp.experts.experts.linear_fc2.weight"


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))


def _hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def _dcp_metadata(directory: Path) -> tuple[dict, dict]:
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(directory)).read_metadata()
    return metadata.state_dict_metadata, metadata.storage_data


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_moe")
    dirs = {variant: save_model(variant, root / variant, seed=i) for i, variant in enumerate(MOE_VARIANTS)}
    for directory in dirs.values():
        save_tokenizer(directory)
    return dirs


@pytest.fixture(scope="module")
def mcore_dirs(hf_dirs, tmp_path_factory) -> dict[tuple[str, int, int, int], Path]:
    root = tmp_path_factory.mktemp("mcore_moe")
    out = {}
    for variant, hf_dir in hf_dirs.items():
        for tp, pp, ep in LAYOUTS:
            out[variant, tp, pp, ep] = root / f"{variant}_tp{tp}_pp{pp}_ep{ep}"
            hf_to_mcore(HfToMcoreOptions(hf_dir=hf_dir, out_dir=out[variant, tp, pp, ep], tp=tp, pp=pp, ep=ep))
    return out


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("tp,pp,ep", LAYOUTS)
@pytest.mark.parametrize("variant", list(MOE_VARIANTS))
def test_round_trip_is_bit_exact(variant, tp, pp, ep, hf_dirs, mcore_dirs, tmp_path):
    mcore_dir = mcore_dirs[variant, tp, pp, ep]
    record = json.loads((mcore_dir / RECORD_FILE).read_text())
    assert (record["expert_model_parallel_size"], record["model_type"]) == (ep, "qwen3_moe")

    out = tmp_path / "hf"
    summary = mcore_to_hf(McoreToHfOptions(mcore_dir=mcore_dir, out_dir=out, max_shard_bytes=64 * 1024))
    source, result = _hf_tensors(hf_dirs[variant]), _hf_tensors(out)
    assert sorted(result) == sorted(source) and summary.num_tensors == len(source)
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in source
    for name, tensor in source.items():
        assert result[name].dtype == tensor.dtype and torch.equal(result[name], tensor), name
    assert (out / "config.json").read_bytes() == (hf_dirs[variant] / "config.json").read_bytes()


def test_expert_keys_and_the_checkpoint_do_not_depend_on_the_layout(mcore_dirs):
    from megatron_rl.models.convert.mcore_io import DistCheckpointReader

    reader = DistCheckpointReader(mcore_dirs["qwen3_moe", 2, 1, 2])
    # [layers, experts, 2 F_e, H] and [layers, experts, H, F_e]; the router is [layers, E, H].
    assert reader.tensors[FC1][0] == (2, 4, 64, 64) and reader.tensors[FC2][0] == (2, 4, 64, 32)
    assert reader.tensors["decoder.layers.mlp.router.weight"][0] == (2, 4, 64)
    assert reader.tensors["decoder.layers.pre_mlp_layernorm.weight"][0] == (2, 64)
    assert not any(".local_experts." in key or key.startswith("decoder.layers.mlp.linear_fc") for key in reader.tensors)
    # One chunk per layer and expert: data files written at different TP/PP/EP are the same
    # bytes, and the metadata indexes them alike (.metadata itself records its own path).
    first, *others = [mcore_dirs[("qwen3_moe", *layout)] for layout in LAYOUTS]
    files = sorted(p.name for p in first.iterdir() if p.name.endswith(".distcp"))
    for other in others:
        assert sorted(p.name for p in other.iterdir() if p.name.endswith(".distcp")) == files
        assert all((first / name).read_bytes() == (other / name).read_bytes() for name in files), other.name
        assert _dcp_metadata(other) == _dcp_metadata(first)


# ----------------------------------------------------------------------------- megatron


def _load_and_forward(rank, world, results, jobs, tokens, reference):
    """Per job: a GPTModel from the adapter at (tp, ep), ``dist_checkpointing.load`` with
    ``strict="raise_all"``, a forward; the job with ``save_to`` then saves the model with
    megatron's own ``dist_checkpointing.save``."""
    from megatron.core import dist_checkpointing, tensor_parallel
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_rl.actor.compat import cpu_shim
    from megatron_rl.models import adapter_for_config, padded_vocab_size

    cpu_shim.apply()
    positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    for job in jobs:
        tp, ep, etp = job["tp"], job["ep"], job.get("etp")
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                     expert_tensor_parallel_size=etp)  # fmt: skip
        with cpu_shim.cuda_to_cpu():
            tensor_parallel.model_parallel_cuda_manual_seed(1234)
        cfg = json.loads((Path(job["hf_dir"]) / "config.json").read_text())
        adapter = adapter_for_config(cfg)
        config = TransformerConfig(
            **adapter.transformer_config_kwargs(cfg),
            **cpu_shim.transformer_config_overrides(),
            tensor_model_parallel_size=tp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp,
            params_dtype=torch.float32,
            pipeline_dtype=torch.float32,
        )
        model = adapter.finish_model(GPTModel(
            config=config, transformer_layer_spec=adapter.layer_spec(cfg), pre_process=True, post_process=True,
            **adapter.gpt_model_kwargs(cfg, padded_vocab_size=padded_vocab_size(cfg["vocab_size"], tp_size=tp))))  # fmt: skip
        state = dist_checkpointing.load(model.sharded_state_dict(), job["mcore_dir"], strict="raise_all")
        model.load_state_dict(state)
        model.eval()
        with torch.no_grad(), cpu_shim.cuda_to_cpu():
            logits = tensor_parallel.gather_from_tensor_model_parallel_region(model(tokens, positions, None))
        diff = float((logits[..., :VOCAB] - reference[job["variant"]]).abs().max())
        padding = float(logits[..., VOCAB:].abs().max())
        results.append((job["name"], rank, diff, padding))
        if job.get("save_to"):
            with cpu_shim.cuda_to_cpu():
                dist_checkpointing.save(model.sharded_state_dict(), job["save_to"])
        ps.destroy_model_parallel()


@pytest.fixture(scope="module")
def megatron_runs(hf_dirs, mcore_dirs, tmp_path_factory) -> tuple[dict, Path]:
    """One 2-rank job: the converted checkpoint at EP=2, at TP=2 and at TP=2 with whole
    experts over EP=2 (expert TP 1), then megatron's own EP=2 save loaded at EP=1. Returns ``({(name, rank): (max |diff|, max |padding|)}, saved dir)``."""
    from transformers import AutoModelForCausalLM

    reference = {}
    for variant, directory in hf_dirs.items():
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager")
        with torch.no_grad():
            reference[variant] = model(_tokens()).logits
    saved = tmp_path_factory.mktemp("megatron_saved") / "ep2"
    saved.mkdir()
    jobs = [
        {"name": "ep2", "variant": "qwen3_moe", "tp": 1, "ep": 2, "save_to": str(saved)},
        {"name": "tp2", "variant": "qwen3_moe", "tp": 2, "ep": 1},
        {"name": "tp2_etp1_ep2", "variant": "qwen3_moe", "tp": 2, "ep": 2, "etp": 1},
        {"name": "tied_ep2", "variant": "qwen3_moe_tied", "tp": 1, "ep": 2},
        {"name": "megatron_ep2_at_ep1", "variant": "qwen3_moe", "tp": 1, "ep": 1, "mcore_dir": str(saved)},
    ]
    for job in jobs:
        job["hf_dir"] = str(hf_dirs[job["variant"]])
        job.setdefault("mcore_dir", str(mcore_dirs[job["variant"], 2, 1, 2]))
    results = run_on_ranks(_load_and_forward, 2, jobs, _tokens(), reference)
    return {(name, rank): (diff, padding) for name, rank, diff, padding in results}, saved


def test_converted_checkpoint_loads_in_megatron_at_ep2_and_tp2_with_transformers_logits(megatron_runs):
    runs, _ = megatron_runs
    assert {name for name, _ in runs} == {"ep2", "tp2", "tp2_etp1_ep2", "tied_ep2", "megatron_ep2_at_ep1"}
    for key, (diff, padding) in runs.items():
        assert diff <= 1e-5 and padding == 0.0, (key, diff, padding)
    print(f"max |megatron - transformers| logit difference: {max(d for d, _ in runs.values()):.3g}")


def test_megatrons_own_save_has_the_converters_keys_and_converts_back(megatron_runs, mcore_dirs, hf_dirs, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    _, saved = megatron_runs

    def layout(directory: Path) -> dict[str, tuple]:
        metadata = FileSystemReader(str(directory)).read_metadata().state_dict_metadata
        return {key: (tuple(md.size), md.properties.dtype) if isinstance(md, TensorStorageMetadata) else "bytes"
                for key, md in metadata.items()}  # fmt: skip

    ours, megatrons = layout(mcore_dirs["qwen3_moe", 2, 1, 2]), layout(saved)
    # megatron-core 0.19 also keeps the common state (empty here) as a sharded object,
    # 0.16 only in common.pt; it is megatron's own, not the model's.
    megatrons = {key: value for key, value in megatrons.items() if not key.startswith("common_state/")}
    assert ours == megatrons
    assert "decoder.layers.mlp.experts.experts.linear_fc2._extra_state/shard_1.3_2.4" in ours
    # The fields both write agree (megatron-core 0.19's writers differ in the common-state
    # fields they add, e.g. common_backend, which the loaders do not need).
    ours_md = json.loads((mcore_dirs["qwen3_moe", 2, 1, 2] / "metadata.json").read_text())
    megatrons_md = json.loads((saved / "metadata.json").read_text())
    shared = ours_md.keys() & megatrons_md.keys()
    assert {"sharded_backend", "sharded_backend_version"} <= shared
    assert all(ours_md[key] == megatrons_md[key] for key in shared), (ours_md, megatrons_md)
    if (saved / "common.pt").exists():  # megatron-core 0.16 (0.19: the common_state object above)
        assert torch.load(saved / "common.pt", weights_only=False) == {}
    else:
        assert any(key.startswith("common_state/") for key in layout(saved))

    out = tmp_path / "hf"
    mcore_to_hf(McoreToHfOptions(mcore_dir=saved, out_dir=out, hf_config_dir=hf_dirs["qwen3_moe"]))
    source, result = _hf_tensors(hf_dirs["qwen3_moe"]), _hf_tensors(out)
    assert sorted(result) == sorted(source)
    assert all(torch.equal(result[name], tensor) for name, tensor in source.items())


# ----------------------------------------------------------------------------- bad input


def _assert_no_output(out: Path) -> None:
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.tmp-")]


@pytest.mark.parametrize(
    "ep,message",
    [
        ("3", r"num_experts=4 is not divisible by the expert-parallel size 3 \(--ep 3\)"),
        ("8", r"num_experts=4 is not divisible by the expert-parallel size 8 \(--ep 8\)"),
        ("0", r"ep \(--ep\) must be an integer >= 1, got 0"),
        ("-2", r"ep \(--ep\) must be an integer >= 1, got -2"),
    ],
)
def test_bad_ep_is_a_one_line_error_naming_the_flag(ep, message, hf_dirs, tmp_path, capsys):
    import re

    out = tmp_path / "out"
    assert convert.main(["hf-to-mcore", "--hf", str(hf_dirs["qwen3_moe"]), "--out", str(out), "--ep", ep]) == 1
    err = capsys.readouterr().err
    assert re.search(message, err) and err.startswith("error: ") and "Traceback" not in err, err
    _assert_no_output(out)


def test_ep_on_a_dense_model_is_refused(tmp_path):
    dense = save_model("qwen3", tmp_path / "dense")
    with pytest.raises(ConversionError, match=r"--ep 2: expert parallelism .* 'qwen3' has no experts"):
        hf_to_mcore(HfToMcoreOptions(hf_dir=dense, out_dir=tmp_path / "out", ep=2))
    with pytest.raises(ConversionError, match=r"--etp 1: expert tensor parallelism .* 'qwen3' has no experts"):
        hf_to_mcore(HfToMcoreOptions(hf_dir=dense, out_dir=tmp_path / "out", etp=1))
    _assert_no_output(tmp_path / "out")


def test_expert_tp_is_checked_against_the_expert_width_and_recorded(hf_dirs, tmp_path, capsys):
    """--etp, not --tp, divides the expert width (32 here): --tp 2 --etp 3 is refused naming
    --etp; --tp 2 --etp 1 converts and records expert TP 1."""
    out = tmp_path / "out"
    argv = ["hf-to-mcore", "--hf", str(hf_dirs["qwen3_moe"]), "--out", str(out), "--tp", "2", "--etp", "3"]
    assert convert.main(argv) == 1
    err = capsys.readouterr().err
    assert "moe_intermediate_size=32 is not divisible by the expert-tensor-parallel size 3 (--etp 3)" in err, err
    _assert_no_output(out)
    assert convert.main([*argv[:-4], "--tp", "2", "--etp", "1"]) == 0
    record = json.loads((out / RECORD_FILE).read_text())
    assert (record["tensor_model_parallel_size"], record["expert_tensor_parallel_size"]) == (2, 1)


def test_a_config_with_another_expert_count_names_the_tensor(hf_dirs, mcore_dirs, tmp_path):
    cfg = json.loads((hf_dirs["qwen3_moe"] / "config.json").read_text())
    cfg["num_local_experts"] = 8
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(cfg))
    message = r"'decoder.layers.mlp.router.weight' .* has shape \[2, 4, 64\]; .* implies \[2, 8, 64\]"
    with pytest.raises(ConversionError, match=message):
        mcore_to_hf(McoreToHfOptions(mcore_dir=mcore_dirs["qwen3_moe", 1, 1, 1], out_dir=tmp_path / "out",
                                     hf_config_dir=tmp_path / "cfg"))  # fmt: skip
    _assert_no_output(tmp_path / "out")


def test_a_damaged_expert_file_is_named(mcore_dirs, tmp_path):
    from megatron_rl.models.convert.mcore_io import DistCheckpointReader

    src = tmp_path / "mc"
    shutil.copytree(mcore_dirs["qwen3_moe", 1, 1, 1], src)
    (data_file,) = DistCheckpointReader(src).files(FC2, (1, 2))
    data = Path(data_file).read_bytes()
    Path(data_file).write_bytes(data[: len(data) // 2])
    with pytest.raises(ConversionError) as info:
        mcore_to_hf(McoreToHfOptions(mcore_dir=src, out_dir=tmp_path / "out"))
    assert f"cannot read tensor '{FC2}' (layer 1, expert 2) from {data_file}" in str(info.value)
    _assert_no_output(tmp_path / "out")
