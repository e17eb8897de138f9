"""HF <-> Megatron adapters (megatron_rl.models): registry, config mapping, tensor layouts.

File-level conversion and the Megatron forward check live in
tests/distributed/test_convert.py; here every mapping is checked in memory.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_rl.config.lib import UnknownNameError
from megatron_rl.models import (
    ConversionError,
    DecoderAdapter,
    adapter_for_config,
    canonical_mcore_name,
    get_adapter,
    index_by_mcore_name,
    padded_vocab_size,
    register_adapter,
    supported_model_types,
)
from megatron_rl.models.registry import ADAPTERS
from megatron_rl.models.weight_units import fuse_qkv, split_qkv
from tests.helpers.tiny_hf import VARIANTS, VOCAB, build_config, build_model, round_trip_through_units


def test_registry_dispatches_by_model_type():
    assert supported_model_types() == ["llama", "qwen2", "qwen3", "qwen3_moe"]
    for model_type in supported_model_types():
        assert get_adapter(model_type).model_type == model_type
    with pytest.raises(ConversionError, match=r"unsupported model_type 'mistral'; supported: llama, qwen2, qwen3, qwen3_moe"):
        get_adapter("mistral")
    with pytest.raises(ValueError, match="already registered"):
        register_adapter(DecoderAdapter(model_type="qwen2", qk_norm=False, qkv_bias=lambda cfg: False))


def test_registry_is_the_generic_one_and_names_hf_architectures():
    import transformers

    assert ADAPTERS.names() == supported_model_types()
    with pytest.raises(UnknownNameError, match="unknown model type 'mistral'; registered: llama, qwen2, qwen3, qwen3_moe"):
        ADAPTERS.get("mistral")
    with pytest.raises(UnknownNameError):  # get_adapter's error is both a ConversionError and this
        get_adapter("mistral")
    expected = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "qwen3_moe": "Qwen3MoeForCausalLM"}
    for model_type, architecture in expected.items():
        assert get_adapter(model_type).architecture == architecture
        assert hasattr(transformers, architecture)
    assert DecoderAdapter(model_type="x", qk_norm=False, qkv_bias=lambda cfg: False).architecture is None


def test_padded_vocab_size():
    assert padded_vocab_size(250, tp_size=1) == 256
    assert padded_vocab_size(250, tp_size=2) == 256
    assert padded_vocab_size(151936, tp_size=1) == 151936  # Qwen2.5: already a multiple of 128
    assert padded_vocab_size(151936, tp_size=4) == 152064
    assert padded_vocab_size(250, tp_size=2, divisible_by=1) == 250
    assert padded_vocab_size(251, tp_size=2, divisible_by=1) == 252


def test_qkv_interleaving_is_per_query_group():
    # nh=4 query heads in ng=2 groups, head_dim 1, hidden 1: rows are head ids.
    q = torch.tensor([[0.0], [1.0], [2.0], [3.0]])
    k = torch.tensor([[10.0], [11.0]])
    v = torch.tensor([[20.0], [21.0]])
    fused = fuse_qkv(q, k, v, num_query_groups=2)
    assert fused.flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    back = split_qkv(fused, num_query_groups=2, q_rows=4, kv_rows=2)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v)))
    # Biases (1-D) use the same layout.
    assert fuse_qkv(q[:, 0], k[:, 0], v[:, 0], num_query_groups=2).tolist() == [0, 1, 10, 20, 2, 3, 11, 21]


def test_qkv_layout_matches_megatron_split():
    """Megatron's SelfAttention view/split of the fused projection recovers HF's q, k, v heads."""
    nh, ng, d, H = 8, 2, 4, 16
    q, k, v = torch.randn(nh * d, H), torch.randn(ng * d, H), torch.randn(ng * d, H)
    fused = fuse_qkv(q, k, v, num_query_groups=ng)
    # What get_query_key_value_tensors does to the projection output (here: the weight rows).
    mixed = fused.view(ng, (nh // ng + 2) * d, H)
    q_m, k_m, v_m = torch.split(mixed, [nh // ng * d, d, d], dim=1)
    assert torch.equal(q_m.reshape(nh, d, H), q.view(nh, d, H))  # query head h is in group h // (nh/ng)
    assert torch.equal(k_m.reshape(ng, d, H), k.view(ng, d, H))
    assert torch.equal(v_m.reshape(ng, d, H), v.view(ng, d, H))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_hf_tensor_round_trips_through_units(variant):
    model = build_model(variant)
    cfg = model.config
    adapter = adapter_for_config(cfg)
    hf = {name: t.detach().clone() for name, t in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        hf.pop("lm_head.weight")  # tied: saved once, as the embedding
    mcore, restored = round_trip_through_units(adapter, cfg, hf)
    for unit in adapter.weight_units(cfg, padded_vocab_size=256):
        if unit.kind == "vocab":
            assert mcore[unit.mcore_name].shape[0] == 256 and torch.count_nonzero(mcore[unit.mcore_name][VOCAB:]) == 0
    assert all(torch.equal(restored[name], hf[name]) for name in hf)


def test_unit_names_and_flags_per_architecture():
    names = {v: {u.mcore_name for u in adapter_for_config(build_config(v)).weight_units(build_config(v), padded_vocab_size=256)} for v in VARIANTS}
    assert "decoder.layers.1.self_attention.linear_qkv.bias" in names["qwen2_gqa"]
    assert "decoder.layers.1.self_attention.linear_qkv.bias" not in names["llama"]
    assert "decoder.layers.0.self_attention.q_layernorm.weight" in names["qwen3"]
    assert "output_layer.weight" in names["qwen2_gqa"] and "output_layer.weight" not in names["qwen2_tied"]
    qwen3 = index_by_mcore_name(get_adapter("qwen3").weight_units(build_config("qwen3"), padded_vocab_size=256))
    qkv = qwen3["decoder.layers.1.self_attention.linear_qkv.weight"]
    assert qkv.sharded_key == "decoder.layers.self_attention.linear_qkv.weight" and qkv.layer == 1
    assert qkv.mcore_shape == ((4 + 2 * 2) * 32, 64)  # head_dim 32 != hidden / heads


def test_export_accepts_any_vocab_padding_and_rejects_too_few_rows():
    adapter = get_adapter("llama")
    cfg = build_config("llama")
    unit = index_by_mcore_name(adapter.weight_units(cfg, padded_vocab_size=256))["output_layer.weight"]
    table = torch.randn(VOCAB, 64)
    for rows in (VOCAB, 256, 512):
        padded = torch.cat([table, torch.zeros(rows - VOCAB, 64)])
        ((name, out),) = adapter.mcore_to_hf(unit, padded)
        assert name == "lm_head.weight" and torch.equal(out, table)
    with pytest.raises(ConversionError, match="wrong vocab size"):
        adapter.mcore_to_hf(unit, torch.randn(VOCAB - 1, 64))
    with pytest.raises(ConversionError, match="'model.layers.0.mlp.gate_proj.weight' has shape"):
        gate_up = index_by_mcore_name(adapter.weight_units(cfg, padded_vocab_size=256))["decoder.layers.0.mlp.linear_fc1.weight"]
        adapter.hf_to_mcore(gate_up, {"model.layers.0.mlp.gate_proj.weight": torch.zeros(95, 64),
                                      "model.layers.0.mlp.up_proj.weight": torch.zeros(96, 64)})


def test_canonical_mcore_name_maps_local_spec_norms():
    assert (canonical_mcore_name("decoder.layers.3.input_layernorm.weight")
            == "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight")
    assert canonical_mcore_name("decoder.layers.0.pre_mlp_layernorm.weight") == "decoder.layers.0.mlp.linear_fc1.layer_norm_weight"
    assert canonical_mcore_name("decoder.final_layernorm.weight") == "decoder.final_layernorm.weight"
    assert canonical_mcore_name("decoder.layers.2.mlp.linear_fc2.weight") == "decoder.layers.2.mlp.linear_fc2.weight"


# ----------------------------------------------------------------------------- configs


def test_config_dict_and_pretrained_config_agree():
    cfg = build_config("qwen2_gqa")
    adapter = get_adapter("qwen2")
    assert adapter.dims(cfg) == adapter.dims(cfg.to_dict())
    dims = adapter.dims(cfg)
    assert (dims.num_query_groups, dims.head_dim, dims.rope_theta, dims.qkv_bias) == (2, 16, 1_000_000.0, True)


def test_legacy_rope_fields_and_llama3_scaling():
    adapter = get_adapter("llama")
    legacy = build_config("llama").to_dict()
    legacy.pop("rope_parameters")
    legacy |= {"rope_theta": 250000.0, "rope_scaling": None}
    assert adapter.dims(legacy).rope_theta == 250000.0 and adapter.dims(legacy).rope_scaling_factor is None

    scaled = dict(legacy, rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    kwargs = adapter.gpt_model_kwargs(scaled, padded_vocab_size=256)
    assert kwargs["rope_scaling"] is True and kwargs["rope_scaling_factor"] == 32.0 and kwargs["rotary_base"] == 250000

    with pytest.raises(ConversionError, match="original_max_position_embeddings"):
        adapter.dims(dict(scaled, rope_scaling=dict(scaled["rope_scaling"], original_max_position_embeddings=4096)))
    with pytest.raises(ConversionError, match="rope_type 'yarn' is not supported"):
        adapter.dims(dict(legacy, rope_scaling={"rope_type": "yarn", "factor": 4.0}))


@pytest.mark.parametrize(
    "variant,change,message",
    [
        ("llama", {"attention_bias": True}, "attention_bias"),
        ("llama", {"mlp_bias": True}, "mlp_bias"),
        ("qwen3", {"attention_bias": True}, "attention_bias"),
        ("qwen2_gqa", {"use_sliding_window": True}, "use_sliding_window"),
        ("qwen2_gqa", {"hidden_act": "gelu"}, "hidden_act"),
        ("qwen2_gqa", {"num_key_value_heads": 3}, "not divisible by num_key_value_heads"),
        ("qwen2_gqa", {"model_type": "qwen3"}, "this adapter is for 'qwen2'"),
    ],
)
def test_unsupported_configs_are_named(variant, change, message):
    cfg = build_config(variant).to_dict() | change
    with pytest.raises(ConversionError, match=message):
        get_adapter(build_config(variant).model_type).dims(cfg)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_transformer_config_kwargs_build_a_megatron_config(variant):
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = build_config(variant)
    adapter = adapter_for_config(cfg)
    config = TransformerConfig(**adapter.transformer_config_kwargs(cfg))
    assert config.normalization == "RMSNorm" and config.gated_linear_unit and not config.add_bias_linear
    assert config.activation_func is torch.nn.functional.silu and config.rotary_interleaved is False
    assert config.ffn_hidden_size == 96 and config.layernorm_epsilon == 1e-6
    assert config.kv_channels == (32 if variant == "qwen3" else 16)
    assert config.num_query_groups == cfg.num_key_value_heads
    assert config.add_qkv_bias == variant.startswith("qwen2")
    assert config.qk_layernorm == (variant == "qwen3")

    kwargs = adapter.gpt_model_kwargs(cfg, padded_vocab_size=256)
    assert kwargs["position_embedding_type"] == "rope" and kwargs["vocab_size"] == 256
    assert kwargs["share_embeddings_and_output_weights"] == cfg.tie_word_embeddings
    assert kwargs["rotary_base"] == cfg.rope_parameters["rope_theta"]

    spec = adapter.layer_spec(cfg)  # CPU: the local spec
    attention = spec.submodules.self_attention.submodules
    assert (attention.q_layernorm is not IdentityOp) == (variant == "qwen3")
    assert "TE" not in attention.linear_qkv.__name__


def test_adapters_are_keyword_only_dataclasses():
    adapter = get_adapter("qwen3")
    assert dataclasses.is_dataclass(adapter)
    with pytest.raises(TypeError):
        DecoderAdapter("x", True, lambda cfg: False)  # type: ignore[misc]


# ----------------------------------------------------------------------------- CPU shim


def test_cuda_to_cpu_mode_redirects_placements():
    from megatron_rl.actor.compat import cpu_shim

    if torch.cuda.is_available():
        pytest.skip("the shim is a no-op with CUDA")
    with cpu_shim.cuda_to_cpu():
        x = torch.zeros(3, device="cuda")
        assert x.device.type == "cpu"
        assert x.cuda() is x and x.to("cuda").device.type == "cpu"
        assert x.type() == "torch.cuda.FloatTensor"
    assert x.type() == "torch.FloatTensor"
    overrides = cpu_shim.transformer_config_overrides()
    assert overrides["use_cpu_initialization"] is True and overrides["apply_rope_fusion"] is False
