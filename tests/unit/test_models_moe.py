"""Qwen3-MoE adapter (megatron_rl.models.moe, models/qwen3_moe): config mapping, weight
units, and a megatron-core GPTModel built from the adapter against transformers.

* The units cover every tensor of a saved ``Qwen3MoeForCausalLM`` (per-expert names, as
  ``save_pretrained`` writes them) once, and HF -> Megatron -> HF is bit-exact, also
  through the parameters of a GPTModel built from the adapter.
* That GPTModel (TP = PP = EP = 1, float32, one gloo process) gives transformers' logits
  within 1e-5, for ``norm_topk_prob`` true and false; with the opposite router order
  (``moe_router_pre_softmax`` flipped) it does not, so the check sees the mapping.
* Config fields the adapter cannot express raise ConversionError naming the field.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.models import ConversionError, adapter_for_config, get_adapter, index_by_mcore_name
from megatron_rl.models.moe import MoEDecoderAdapter
from tests.dist_utils import run_on_ranks
from tests.helpers.tiny_hf import MOE_VARIANTS, VOCAB, build_config, round_trip_through_units, save_model

BATCH, SEQ = 2, 12


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_moe")
    return {variant: save_model(variant, root / variant, seed=i) for i, variant in enumerate(MOE_VARIANTS)}


def _saved(directory: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    return json.loads((directory / "config.json").read_text()), load_file(directory / "model.safetensors")


# ----------------------------------------------------------------------------- config


def test_registered_under_its_model_type_and_architecture():
    import transformers

    adapter = get_adapter("qwen3_moe")
    assert isinstance(adapter, MoEDecoderAdapter) and adapter.qk_norm
    assert adapter.architecture == "Qwen3MoeForCausalLM" and hasattr(transformers, adapter.architecture)
    assert adapter_for_config(build_config("qwen3_moe")) is adapter


@pytest.mark.parametrize("variant", list(MOE_VARIANTS))
def test_transformer_config_kwargs_build_a_megatron_moe_config(variant):
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = build_config(variant)
    adapter = adapter_for_config(cfg)
    kwargs = adapter.transformer_config_kwargs(cfg)
    config = TransformerConfig(**kwargs)
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == (4, 2, 32)
    assert config.moe_router_pre_softmax is (not cfg.norm_topk_prob)
    assert config.moe_router_score_function == "softmax" and config.moe_router_topk_scaling_factor is None
    assert config.moe_router_load_balancing_type == "aux_loss" and config.moe_aux_loss_coeff == cfg.router_aux_loss_coef
    assert config.moe_shared_expert_intermediate_size is None and config.moe_layer_freq == 1
    assert config.moe_token_dispatcher_type == "alltoall"  # the one megatron allows with variable lengths
    assert config.moe_grouped_gemm is False and adapter.transformer_config_kwargs(cfg, use_te=True)["moe_grouped_gemm"]
    assert config.ffn_hidden_size == 96 and config.kv_channels == 16 and config.qk_layernorm
    assert not config.add_bias_linear and not config.add_qkv_bias and config.gated_linear_unit
    # config.json of transformers 5 says num_local_experts; hub files say num_experts.
    saved = cfg.to_dict()
    assert "num_local_experts" in saved and saved.get("num_experts") is None
    hub = {k: v for k, v in saved.items() if k != "num_local_experts"} | {"num_experts": 4}
    assert adapter.transformer_config_kwargs(hub) == kwargs


def _builder(spec) -> tuple[type, object]:
    """(module class, submodules) of a spec entry: a ModuleSpec (megatron-core 0.16) or a
    functools.partial of the class (0.19)."""
    if isinstance(spec, functools.partial):
        return spec.func, spec.keywords["submodules"]
    return spec.module, spec.submodules


def test_local_layer_spec_is_megatrons_moe_layer_with_a_torch_router():
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_rl.models.attention import PackedDotProductAttention

    cfg = build_config("qwen3_moe")
    layer = get_adapter("qwen3_moe").layer_spec(cfg, use_te=False).submodules
    moe, moe_sub = _builder(layer.mlp)
    experts, experts_sub = _builder(moe_sub.experts)
    assert moe is MoELayer and experts is SequentialMLP
    assert issubclass(moe_sub.router, TopKRouter) and moe_sub.router is not TopKRouter
    assert experts_sub.linear_fc1.__name__ == "ColumnParallelLinear"
    assert layer.self_attention.submodules.core_attention is PackedDotProductAttention
    # The pre-MLP norm keeps its key (the TE MoE layer's); input_layernorm is mapped as for dense layers.
    assert layer.sharded_state_dict_keys_map == {"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}
    with pytest.raises(TypeError, match="needs the HF config"):
        get_adapter("qwen3_moe").layer_spec()


@pytest.mark.parametrize(
    "change,message",
    [
        ({"decoder_sparse_step": 2}, r"decoder_sparse_step=2 makes layers \[0\] dense"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step=0 must be a positive integer"),
        ({"mlp_only_layers": [1]}, r"mlp_only_layers=\[1\] makes layers \[1\] dense"),
        ({"num_local_experts": 0}, "num_local_experts=0 is not supported"),
        ({"num_local_experts": None}, "'num_experts' .* is missing"),
        ({"num_experts": 8}, "num_experts=8 and num_local_experts=4 disagree"),
        ({"num_experts_per_tok": 5}, r"num_experts_per_tok=5 must be an integer in \[1, 4\]"),
        ({"moe_intermediate_size": None}, "moe_intermediate_size=None"),
        ({"norm_topk_prob": "yes"}, "norm_topk_prob='yes'"),
        ({"router_aux_loss_coef": -1.0}, "router_aux_loss_coef=-1.0"),
        ({"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size"),
        ({"attention_bias": True}, "attention_bias"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_unsupported_configs_are_named(change, message):
    cfg = build_config("qwen3_moe").to_dict() | change
    adapter = get_adapter("qwen3_moe")
    for call in (adapter.transformer_config_kwargs, lambda c: adapter.weight_units(c, padded_vocab_size=256)):
        with pytest.raises(ConversionError, match=message):
            call(cfg)


def test_missing_router_fields_take_transformers_defaults():
    cfg = build_config("qwen3_moe").to_dict()
    for key in ("norm_topk_prob", "router_aux_loss_coef", "decoder_sparse_step", "mlp_only_layers"):
        cfg.pop(key)
    dims = get_adapter("qwen3_moe").moe_dims(cfg)
    assert dims.norm_topk_prob is False and dims.router_aux_loss_coef == 0.001


# ----------------------------------------------------------------------------- weights


@pytest.mark.parametrize("variant", list(MOE_VARIANTS))
def test_every_hf_tensor_round_trips_through_units(variant, hf_dirs):
    cfg, hf = _saved(hf_dirs[variant])
    adapter = adapter_for_config(cfg)
    _, restored = round_trip_through_units(adapter, cfg, hf)
    assert all(torch.equal(restored[name], hf[name]) for name in hf)


def test_expert_units_name_the_global_expert_and_its_checkpoint_axis():
    cfg = build_config("qwen3_moe")
    adapter = get_adapter("qwen3_moe")
    units = index_by_mcore_name(adapter.weight_units(cfg, padded_vocab_size=256))
    fc1 = units["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"]
    assert fc1.hf_names == (
        "model.layers.1.mlp.experts.3.gate_proj.weight",
        "model.layers.1.mlp.experts.3.up_proj.weight",
    )
    assert (fc1.kind, fc1.mcore_shape, fc1.layer, fc1.expert, fc1.num_experts) == ("gate_up", (64, 64), 1, 3, 4)
    assert fc1.sharded_key == "decoder.layers.mlp.experts.experts.linear_fc1.weight"
    fc2 = units["decoder.layers.0.mlp.experts.local_experts.2.linear_fc2.weight"]
    assert (fc2.hf_names, fc2.mcore_shape, fc2.expert) == (
        ("model.layers.0.mlp.experts.2.down_proj.weight",),
        (64, 32),
        2,
    )
    router = units["decoder.layers.0.mlp.router.weight"]
    assert (router.hf_names, router.mcore_shape, router.expert) == (("model.layers.0.mlp.gate.weight",), (4, 64), None)
    norm = units["decoder.layers.0.pre_mlp_layernorm.weight"]
    assert norm.sharded_key == "decoder.layers.pre_mlp_layernorm.weight"
    assert norm.hf_names == ("model.layers.0.post_attention_layernorm.weight",)
    assert not any("linear_fc1.layer_norm" in name or ".mlp.linear_fc" in name for name in units)


def test_canonical_names_of_both_specs():
    adapter = get_adapter("qwen3_moe")
    assert (adapter.canonical_mcore_name("decoder.layers.3.input_layernorm.weight")
            == "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight")  # fmt: skip
    for name in ("decoder.layers.3.pre_mlp_layernorm.weight", "decoder.layers.0.mlp.router.weight",
                 "decoder.layers.0.mlp.experts.local_experts.7.linear_fc2.weight", "output_layer.weight"):  # fmt: skip
        assert adapter.canonical_mcore_name(name) == name
    # Transformer-Engine grouped GEMM: one parameter per local expert, weight<j>.
    assert (adapter.canonical_mcore_name("decoder.layers.2.mlp.experts.linear_fc1.weight11")
            == "decoder.layers.2.mlp.experts.local_experts.11.linear_fc1.weight")  # fmt: skip
    assert get_adapter("qwen3").canonical_mcore_name("decoder.layers.0.pre_mlp_layernorm.weight") == (
        "decoder.layers.0.mlp.linear_fc1.layer_norm_weight"
    )


# ----------------------------------------------------------------------------- megatron


def _megatron_pass(rank, world, results, hf_dirs):
    """Per variant: build GPTModel from the adapter, load the HF weights unit by unit, run
    a forward (and one with the router order flipped), export the parameters back to HF."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_rl.actor.compat import cpu_shim
    from megatron_rl.models import padded_vocab_size

    cpu_shim.apply()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    with cpu_shim.cuda_to_cpu():
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
    tokens = _tokens()
    positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    try:
        for variant, directory in hf_dirs.items():
            cfg, hf = _saved(directory)
            adapter = adapter_for_config(cfg)
            vp = padded_vocab_size(cfg["vocab_size"], tp_size=1)
            kwargs = adapter.transformer_config_kwargs(cfg) | cpu_shim.transformer_config_overrides()
            units = index_by_mcore_name(adapter.weight_units(cfg, padded_vocab_size=vp))
            outputs = {}
            for flipped in (False, True):
                pre_softmax = kwargs["moe_router_pre_softmax"] != flipped
                config = TransformerConfig(**kwargs | {"moe_router_pre_softmax": pre_softmax},
                                           params_dtype=torch.float32, pipeline_dtype=torch.float32)  # fmt: skip
                model = GPTModel(config=config, transformer_layer_spec=adapter.layer_spec(cfg), pre_process=True,
                                 post_process=True, **adapter.gpt_model_kwargs(cfg, padded_vocab_size=vp))  # fmt: skip
                state = model.state_dict()
                names = {adapter.canonical_mcore_name(n): n for n in state if not n.endswith("._extra_state")}
                results.append((variant, "unmatched", sorted(set(names) ^ set(units))))
                loaded = dict(state)
                for name, unit in units.items():
                    loaded[names[name]] = adapter.hf_to_mcore(unit, {n: hf[n] for n in unit.hf_names})
                model.load_state_dict(loaded, strict=True)
                model.eval()
                with torch.no_grad():
                    outputs[flipped] = model(tokens, positions, attention_mask=None)  # [b, s, Vp]
                if not flipped:  # back to HF from the model's own parameters
                    sharded = model.sharded_state_dict()
                    keys = {v.key: tuple(getattr(v, "global_shape", ())) for v in sharded.values()}
                    results.append((variant, "sharded_keys", keys))
                    params = model.state_dict()
                    exported = {}
                    for name, unit in units.items():
                        exported.update((n, t.clone()) for n, t in adapter.mcore_to_hf(unit, params[names[name]]))
            results.append((variant, "logits", outputs[False]))
            results.append((variant, "flipped_logits", outputs[True]))
            results.append((variant, "exported", exported))
    finally:
        parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module")
def megatron(hf_dirs) -> dict[tuple[str, str], object]:
    return {(variant, what): value for variant, what, value in run_on_ranks(_megatron_pass, 1, hf_dirs)}


@pytest.fixture(scope="module")
def hf_logits(hf_dirs) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    out = {}
    for variant, directory in hf_dirs.items():
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager")
        with torch.no_grad():
            out[variant] = model(_tokens()).logits
    return out


@pytest.mark.parametrize("variant", list(MOE_VARIANTS))
def test_megatron_logits_match_transformers(variant, megatron, hf_logits):
    assert megatron[variant, "unmatched"] == [], "every GPTModel parameter is a unit and every unit a parameter"
    logits, want = megatron[variant, "logits"], hf_logits[variant]
    assert float(want.abs().max()) > 0.5  # not trivially small
    torch.testing.assert_close(logits[..., :VOCAB], want, atol=1e-5, rtol=0)
    assert torch.count_nonzero(logits[..., VOCAB:]) == 0  # padded vocabulary rows are zeros


@pytest.mark.parametrize("variant", list(MOE_VARIANTS))
def test_the_other_router_order_gives_other_logits(variant, megatron, hf_logits):
    """Flipping moe_router_pre_softmax changes the expert weights, so the match above is
    evidence for the norm_topk_prob mapping, not a coincidence of the routing."""
    flipped = megatron[variant, "flipped_logits"][..., :VOCAB]
    assert float((flipped - hf_logits[variant]).abs().max()) > 1e-2


@pytest.mark.parametrize("variant", list(MOE_VARIANTS))
def test_round_trip_through_gpt_model_is_bit_exact(variant, megatron, hf_dirs):
    _, source = _saved(hf_dirs[variant])
    exported = megatron[variant, "exported"]
    assert sorted(exported) == sorted(source)
    for name, tensor in source.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name


@pytest.mark.parametrize("variant", list(MOE_VARIANTS))
def test_unit_keys_are_the_gpt_models_checkpoint_keys(variant, megatron, hf_dirs):
    """The dist-checkpoint keys a converter writes (``sharded_key``) are the ones the
    GPTModel asks for; experts are stacked on an expert axis after the layer axis."""
    cfg, _ = _saved(hf_dirs[variant])
    units = get_adapter("qwen3_moe").weight_units(cfg, padded_vocab_size=256)
    keys = megatron[variant, "sharded_keys"]
    assert {u.sharded_key for u in units} == {k for k in keys if not k.endswith("._extra_state")}
    assert keys["decoder.layers.pre_mlp_layernorm.weight"] == (2, 64)
    assert keys["decoder.layers.mlp.router.weight"] == (2, 4, 64)
    assert keys["decoder.layers.mlp.experts.experts.linear_fc2.weight"] == (2, 4, 64, 32)


@pytest.mark.parametrize(
    ("model", "sizes", "field", "message"),
    [
        ("qwen3", dict(num_actor_ranks=2, expert_model_parallel_size=2), "expert_model_parallel_size", "has no experts"),
        ("qwen3_moe", dict(num_actor_ranks=8, expert_model_parallel_size=8), "expert_model_parallel_size",
         "must divide the 4 experts"),
        ("qwen3_moe", dict(num_actor_ranks=2, tensor_model_parallel_size=2), "sequence_parallel", "needs it"),
        ("qwen3_moe", dict(num_actor_ranks=64, tensor_model_parallel_size=64, sequence_parallel=True),
         "tensor_model_parallel_size", r"must divide the expert width \(moe_intermediate_size 32\)"),
    ],
)  # fmt: skip
def test_the_expert_layout_is_checked_against_the_model(hf_dirs, model, sizes, field, message):
    from megatron_rl.config.lib import ConfigError
    from megatron_rl.config.parallel import ParallelConfig
    from megatron_rl.loop.preflight import check_expert_layout
    from tests.helpers.tiny_hf import save_model

    directory = hf_dirs.get(model) or save_model(model, hf_dirs["qwen3_moe"].parent / model, seed=0)
    cfg, _ = _saved(directory)
    with pytest.raises(ConfigError, match=message) as info:
        check_expert_layout(get_adapter(model), cfg, ParallelConfig(**sizes), where="the model")
    assert info.value.path == f"parallel.{field}"
    check_expert_layout(get_adapter("qwen3_moe"), _saved(hf_dirs["qwen3_moe"])[0],
                        ParallelConfig(num_actor_ranks=4, expert_model_parallel_size=4), where="the model")  # fmt: skip


def test_the_preflight_takes_a_moe_model_and_conversion_its_checkpoint(hf_dirs, tmp_path):
    """A Qwen3-MoE model passes the pre-flight (the actor, weight sync and the built-in
    engine handle it: tests/distributed/test_actor_moe.py) and ``megatron-rl convert`` its
    checkpoints at EP = 2 (tests/distributed/test_convert_moe.py)."""
    from megatron_rl.loop.preflight import preflight
    from megatron_rl.models.convert.hf_mcore import ConversionWarning, HfToMcoreOptions, hf_to_mcore
    from tests.e2e.conftest import tiny_config

    hf = hf_dirs["qwen3_moe"]
    config = tiny_config(tmp_path, "model.tiny=null", f"model.hf_config={hf}", "model.init=pretrained")
    preflight(config)
    with pytest.warns(ConversionWarning, match="no tokenizer files"):
        summary = hf_to_mcore(HfToMcoreOptions(hf_dir=hf, out_dir=tmp_path / "mcore", ep=2))
    assert summary.model_type == "qwen3_moe" and (tmp_path / "mcore" / "metadata.json").is_file()


@pytest.mark.parametrize(
    ("overrides", "field", "message"),
    [
        ((), "rollout.routing_replay", "has no experts to route"),  # the dense demo
        (("model.tiny=null", "model.hf_config={moe}", "model.init=pretrained", "rollout.engine=vllm"),
         "rollout.routing_replay", "vLLM's CPU build"),
        (("model.tiny=null", "model.hf_config={moe}", "model.init=pretrained",
          "model.transformer_config_overrides={{moe_router_fusion: true}}"),
         "model.transformer_config_overrides.moe_router_fusion", "fused router"),
        (("rollout.engine_args={{return_routed_experts: true}}",), "rollout.engine_args.return_routed_experts",
         "set rollout.routing_replay instead"),
    ],
    ids=["dense", "vllm_cpu", "fused_router", "engine_args"],
)  # fmt: skip
def test_routing_replay_is_refused_where_it_cannot_run(hf_dirs, tmp_path, overrides, field, message):
    import importlib.util

    from megatron_rl.config.lib import ConfigError
    from megatron_rl.loop.preflight import preflight
    from tests.e2e.conftest import tiny_config

    if "rollout.engine=vllm" in overrides and importlib.util.find_spec("vllm") is None:
        pytest.skip("the vLLM CPU build is not installed")
    overrides = [o.format(moe=hf_dirs["qwen3_moe"]) for o in overrides]
    with pytest.raises(ConfigError) as info:
        preflight(tiny_config(tmp_path, *overrides, "rollout.routing_replay=true"))
    assert info.value.path == field and message in str(info.value), info.value


def test_a_user_engine_without_routes_is_refused_for_routing_replay(hf_dirs, tmp_path):
    from megatron_rl.config.lib import ConfigError
    from megatron_rl.loop.preflight import preflight
    from tests.e2e.conftest import tiny_config

    config = tiny_config(tmp_path, "model.tiny=null", f"model.hf_config={hf_dirs['qwen3_moe']}", "model.init=pretrained",
                         "rollout.engine=tests.helpers.rollout_engines:NoRoutesEngine", "rollout.routing_replay=true")  # fmt: skip
    with pytest.raises(ConfigError, match="does not return routed experts") as info:
        preflight(config)
    assert info.value.path == "rollout.routing_replay"
    preflight(tiny_config(tmp_path, "model.tiny=null", f"model.hf_config={hf_dirs['qwen3_moe']}",
                          "model.init=pretrained", "rollout.routing_replay=true"))  # fmt: skip


def test_vllms_own_expert_parallelism_is_refused_on_its_cpu_build(tmp_path):
    """vllm-cpu 0.32 segfaults in its fused-MoE kernel at the first generation of a TP = 2
    engine with ``enable_expert_parallel`` (measured): refused before start, naming the field;
    a dense model (no fused MoE) and a MoE model without it pass."""
    import importlib.util

    from megatron_rl.config.lib import ConfigError
    from megatron_rl.loop.preflight import preflight
    from tests.e2e.conftest import MOE_EXAMPLE, tiny_config

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("the vLLM CPU build is not installed")
    vllm = ("rollout.engine=vllm", "model.tiny.hidden_size=128", "model.tiny.num_attention_heads=2",
            "model.tiny.num_key_value_heads=2")  # head size 64, one vLLM's CPU attention runs  # fmt: skip
    expert_parallel = "rollout.engine_args={enable_expert_parallel: true}"
    with pytest.raises(ConfigError, match="crashes in its fused-MoE kernel") as info:
        preflight(tiny_config(tmp_path, *vllm, expert_parallel, example=MOE_EXAMPLE))
    assert info.value.path == "rollout.engine_args.enable_expert_parallel"
    preflight(tiny_config(tmp_path, *vllm, example=MOE_EXAMPLE))
    preflight(tiny_config(tmp_path, *vllm, expert_parallel))
