"""A LoRA checkpoint's adapters on the way to HF (megatron_rl/models/convert/lora_export.py),
against the written-out formula in float64: the merged fused weights split into the HF
projections equal each projection's ``W + (alpha / r) B_p A``, and PEFT's tensors are A whole
and B's rows of each projection. The refusals name the tensor, the file or the flag.
(The exports of a trained LoRA actor loaded in transformers and peft:
tests/distributed/test_lora.py.)"""

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from megatron_rl.cli.convert import recorded_lora
from megatron_rl.models import adapter_for_config
from megatron_rl.models.convert.hf_mcore import McoreToHfOptions, _check_mcore_tensors
from megatron_rl.models.convert.lora_export import (
    LoRAExport,
    adapted_units,
    adapter_keys,
    merge_adapter,
    peft_tensors,
)
from megatron_rl.models.weight_units import ConversionError, checkpoint_region, hf_to_mcore, mcore_to_hf

QWEN2 = {"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64}  # fmt: skip
LORA = LoRAExport(rank=3, alpha=6.0, target_modules=("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"))


def _units():
    return adapter_for_config(QWEN2).weight_units(QWEN2, padded_vocab_size=128)


def test_adapted_units_are_the_targeted_layer_weights():
    names = [u.sharded_key for u in adapted_units(_units(), LORA)]
    assert names == [f"decoder.layers.{m}.weight" for _ in range(2) for m in (
        "self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")]  # fmt: skip
    only_qkv = LoRAExport(rank=3, alpha=6.0, target_modules=("linear_qkv",))
    assert [u.layer for u in adapted_units(_units(), only_qkv)] == [0, 1]
    assert adapter_keys(adapted_units(_units(), only_qkv)[0]) == (
        "decoder.layers.self_attention.linear_qkv.lora_a", "decoder.layers.self_attention.linear_qkv.lora_b")


@pytest.mark.parametrize("target", ["linear_qkv", "linear_fc1", "linear_proj"])
def test_merged_and_peft_tensors_are_the_same_update_per_hf_projection(target):
    unit = next(u for u in adapted_units(_units(), LORA) if f".{target}." in u.sharded_key)
    g = torch.Generator().manual_seed(0)
    out_rows, in_cols = unit.mcore_shape
    w = torch.randn(out_rows, in_cols, generator=g)
    a, b = torch.randn(LORA.rank, in_cols, generator=g), torch.randn(out_rows, LORA.rank, generator=g)
    merged = dict(mcore_to_hf(unit, merge_adapter(unit, w, a, b, LORA)))
    base = dict(mcore_to_hf(unit, w))
    peft = dict(peft_tensors(unit, a, b, LORA))
    assert len(peft) == 2 * len(unit.hf_names)
    for hf_name in unit.hf_names:
        module = "base_model.model." + hf_name.removesuffix(".weight")
        pa, pb = peft[f"{module}.lora_A.weight"], peft[f"{module}.lora_B.weight"]
        assert torch.equal(pa, a) and pa.data_ptr() != a.data_ptr()
        want = base[hf_name].double() + LORA.scale * pb.double() @ pa.double()
        assert torch.allclose(merged[hf_name].double(), want, atol=1e-5, rtol=0), hf_name
    # B's rows per projection are exactly the weight's rows: the fused B rebuilt from them is B.
    b_parts = {n: peft["base_model.model." + n.removesuffix(".weight") + ".lora_B.weight"] for n in unit.hf_names}
    rows_unit = dataclasses.replace(unit, mcore_shape=(out_rows, LORA.rank),
                                    hf_shapes=tuple((s[0], LORA.rank) for s in unit.hf_shapes))  # fmt: skip
    assert torch.equal(hf_to_mcore(rows_unit, b_parts), b)


def test_an_adapter_of_the_wrong_rank_is_named():
    unit = adapted_units(_units(), LORA)[0]
    out_rows, in_cols = unit.mcore_shape
    with pytest.raises(ConversionError, match=r"'decoder.layers.self_attention.linear_qkv.lora_a' \(layer 0\).*rank 3"):
        merge_adapter(unit, torch.zeros(out_rows, in_cols), torch.zeros(4, in_cols), torch.zeros(out_rows, 4), LORA)


def _reader(tensors):
    return SimpleNamespace(tensors=tensors, directory="CKPT", files=lambda key, index=(): ["CKPT/__0_0.distcp"])


def _stored(lora: bool):
    units = _units()
    dims = adapter_for_config(QWEN2).dims(QWEN2)
    tensors = {u.sharded_key: (checkpoint_region(u, 2)[0] if u.layer is not None else tuple(u.mcore_shape), torch.float32)
               for u in units}  # fmt: skip
    if lora:
        for u in adapted_units(units, LORA):
            a_key, b_key = adapter_keys(u)
            tensors[a_key] = ((2, LORA.rank, u.mcore_shape[1]), torch.float32)
            tensors[b_key] = ((2, u.mcore_shape[0], LORA.rank), torch.float32)
    return units, dims, tensors


def test_the_check_wants_each_recorded_adapter_and_refuses_unrecorded_ones(tmp_path):
    units, dims, tensors = _stored(lora=True)
    _check_mcore_tensors(_reader(tensors), units, dims, tmp_path / "config.json", LORA)
    with pytest.raises(ConversionError, match="holds LoRA adapters .* records no LoRA settings"):
        _check_mcore_tensors(_reader(tensors), units, dims, tmp_path / "config.json", None)
    del tensors["decoder.layers.mlp.linear_fc2.lora_b"]
    with pytest.raises(ConversionError, match="missing adapter tensor 'decoder.layers.mlp.linear_fc2.lora_b'"):
        _check_mcore_tensors(_reader(tensors), units, dims, tmp_path / "config.json", LORA)
    units, dims, plain = _stored(lora=False)
    _check_mcore_tensors(_reader(plain), units, dims, tmp_path / "config.json", None)


def test_the_lora_record_is_read_from_actor_state_json(tmp_path):
    assert recorded_lora(tmp_path) is None  # a converted checkpoint has no actor_state.json
    (tmp_path / "actor_state.json").write_text(json.dumps({"lora": None}))
    assert recorded_lora(tmp_path) is None
    (tmp_path / "actor_state.json").write_text(json.dumps({"lora": {"rank": 8, "alpha": 16, "target_modules": ["linear_qkv"]}}))
    assert recorded_lora(tmp_path) == LoRAExport(rank=8, alpha=16.0, target_modules=("linear_qkv",))
    (tmp_path / "actor_state.json").write_text(json.dumps({"lora": {"rank": 8}}))
    with pytest.raises(ConversionError, match=r"actor_state.json: cannot read its 'lora' record: KeyError"):
        recorded_lora(tmp_path)


def test_the_options_need_an_output(tmp_path):
    with pytest.raises(ValueError, match=r"nothing to write: give out_dir \(--out\), peft_dir \(--peft-out\)"):
        McoreToHfOptions(mcore_dir=tmp_path, out_dir=None)


def test_an_adapter_only_checkpoint_needs_its_recorded_base_to_merge(tmp_path):
    from megatron_rl.storage.checkpoints import weights_fingerprint

    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    (base / "model.safetensors").write_bytes(b"weights" * 100)
    lora = {"rank": 8, "alpha": 16, "target_modules": ["linear_qkv"]}
    record = {"lora": lora, "base_weights": {"path": str(base), "fingerprint": weights_fingerprint(base)}}
    (tmp_path / "actor_state.json").write_text(json.dumps(record))
    assert recorded_lora(tmp_path, need_base=True).base_dir == base
    (base / "model.safetensors").write_bytes(b"other!!" * 100)
    with pytest.raises(ConversionError, match="trained over other weights than those now in"):
        recorded_lora(tmp_path, need_base=True)
    assert recorded_lora(tmp_path).base_dir == base  # the PEFT adapter alone needs no base
    record["base_weights"]["path"] = str(tmp_path / "gone")
    (tmp_path / "actor_state.json").write_text(json.dumps(record))
    with pytest.raises(ConversionError, match=r"holds LoRA adapters only; their base weights, .*gone \(its actor_state.json\), are gone"):
        recorded_lora(tmp_path, need_base=True)


def test_adapter_sync_needs_an_engine_that_loads_adapters():
    """``rollout.lora_sync: adapter`` is refused for an engine without LoRA support, naming
    the field; vLLM engines are sized to the smallest LoRA rank vLLM offers that holds r."""
    from megatron_rl.config.lib import ConfigError
    from megatron_rl.config.rollout import RolloutConfig
    from megatron_rl.rollout.pool.worker import engine_class
    from megatron_rl.weight_sync.adapters import engine_lora_rank
    from megatron_rl.weight_sync.sync import resolve_transport

    with pytest.raises(ConfigError, match="rollout.lora_sync.*loads no LoRA adapters"):
        resolve_transport(RolloutConfig(lora_sync="adapter"), engine_class("hf"), cuda=False)
    assert resolve_transport(RolloutConfig(engine="vllm", lora_sync="adapter"), engine_class("vllm"), cuda=False)
    assert [engine_lora_rank(r) for r in (1, 2, 8, 9, 64, 300, 512)] == [1, 8, 8, 16, 64, 320, 512]
    with pytest.raises(ValueError, match="up to rank 512"):
        engine_lora_rank(513)
