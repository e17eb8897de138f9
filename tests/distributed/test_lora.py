"""LoRA adapters on megatron's tensor-parallel linears (megatron_rl/models/lora.py).

An MLP-shaped pair, column-parallel ``[in -> mid]`` then row-parallel ``[mid -> out]``, each
with an adapter, on 1 and 2 gloo ranks, with and without sequence parallelism: outputs and
the gradients of the input and of every adapter parameter, gathered whole, equal a float64
reference ``W x + (alpha / r) B A x`` (and so each other); the base weights get no gradient;
with B = 0 (the initialisation) the pair equals the base layers exactly; the adapter's A is
the same in every layout.
"""

import json
import typing
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.dist_utils import run_on_ranks

IN, MID, OUT, RANK, ALPHA, SEQ, BATCH = 16, 24, 8, 4, 8.0, 6, 2


def _full_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {
        "w1": torch.randn(MID, IN, generator=g, dtype=torch.float64) / 4,
        "w2": torch.randn(OUT, MID, generator=g, dtype=torch.float64) / 4,
        "b1": torch.randn(MID, RANK, generator=g, dtype=torch.float64),  # B of the column-parallel layer
        "b2": torch.randn(OUT, RANK, generator=g, dtype=torch.float64),  # B of the row-parallel layer
        "x": torch.randn(SEQ, BATCH, IN, generator=g, dtype=torch.float64),
        "dy": torch.randn(SEQ, BATCH, OUT, generator=g, dtype=torch.float64),
    }


CASES = [(1, False, False), (2, False, False), (2, True, False), (2, False, True)]
"""(TP, sequence parallel, B zero), run one after the other by the same two ranks."""


def _cases(rank, world, results):
    from megatron.core import parallel_state, tensor_parallel

    from megatron_rl.actor.compat import cpu_shim

    cpu_shim.apply()
    for case in CASES:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=case[0])
        with cpu_shim.cuda_to_cpu():
            tensor_parallel.model_parallel_cuda_manual_seed(1)
        try:
            out = _pass(*case)
        finally:
            parallel_state.destroy_model_parallel()
        if rank == 0:
            results.append((case, out))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    with cpu_shim.cuda_to_cpu():
        tensor_parallel.model_parallel_cuda_manual_seed(1)
    try:
        out = _gpt_models()
    finally:
        parallel_state.destroy_model_parallel()
    if rank == 0:
        results.append(("gpt", out))


QWEN2 = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128}  # fmt: skip


def _gpt_models() -> dict:
    """A GPTModel from the adapter's layer spec and one from ``with_lora`` of it (TP = 2),
    the same base weights: with B = 0 their logits are equal."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_rl.actor.compat import cpu_shim
    from megatron_rl.models import adapter_for_config, padded_vocab_size
    from megatron_rl.models.lora import LoRASettings, init_lora, with_lora

    adapter = adapter_for_config(QWEN2)
    vocab = padded_vocab_size(QWEN2["vocab_size"], tp_size=2)
    config = TransformerConfig(**adapter.transformer_config_kwargs(QWEN2) | cpu_shim.transformer_config_overrides(),
                               tensor_model_parallel_size=2, params_dtype=torch.float32, pipeline_dtype=torch.float32)  # fmt: skip
    spec = adapter.layer_spec(QWEN2, use_te=False)
    models = {}
    for name, layer_spec in (
        ("base", spec),
        ("lora", with_lora(spec, LoRASettings(rank=4, alpha=8.0))),
    ):
        models[name] = GPTModel(config=config, transformer_layer_spec=layer_spec, pre_process=True, post_process=True,
                                **adapter.gpt_model_kwargs(QWEN2, padded_vocab_size=vocab))  # fmt: skip
    adapted = init_lora([models["lora"]])
    missing, unexpected = models["lora"].load_state_dict(models["base"].state_dict(), strict=False)
    tokens = torch.randint(0, QWEN2["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(8).unsqueeze(0).expand(2, 8)
    with torch.no_grad():
        logits = {n: m.eval()(tokens, positions, attention_mask=None) for n, m in models.items()}
    return {"adapted": adapted, "missing": sorted(missing), "unexpected": sorted(unexpected), "logits": logits,
            "trainable": sorted(n for n, p in models["lora"].named_parameters() if p.requires_grad)}  # fmt: skip


def _pass(world, sequence_parallel, zero_b):
    """One layout on this rank (TP group of size ``world``); tensors gathered whole."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.model_parallel_config import ModelParallelConfig

    from megatron_rl.models.lora import LoRAColumnParallelLinear, LoRARowParallelLinear, LoRASettings

    group = parallel_state.get_tensor_model_parallel_group()
    rank = parallel_state.get_tensor_model_parallel_rank()
    config = ModelParallelConfig(tensor_model_parallel_size=world, sequence_parallel=sequence_parallel,
                                 use_cpu_initialization=True, params_dtype=torch.float32)  # fmt: skip
    lora = LoRASettings(rank=RANK, alpha=ALPHA, seed=3)
    init = torch.nn.init.zeros_
    col = LoRAColumnParallelLinear(IN, MID, config=config, init_method=init, bias=False, gather_output=False,
                                   lora=lora, lora_name="linear_fc1")  # fmt: skip
    row = LoRARowParallelLinear(MID, OUT, config=config, init_method=init, bias=False, input_is_parallel=True,
                                skip_bias_add=True, lora=lora, lora_name="linear_fc2")  # fmt: skip
    col.reset_adapter(layer_number=1)
    row.reset_adapter(layer_number=1)
    full = _full_tensors()
    shard = slice(rank * MID // world, (rank + 1) * MID // world)  # of the MID axis
    with torch.no_grad():
        col.weight.copy_(full["w1"][shard])
        row.weight.copy_(full["w2"][:, shard])
        if not zero_b:
            col.lora_b.copy_(full["b1"][shard])
            row.lora_b.copy_(full["b2"])
    x_full = full["x"].float()
    seq = slice(rank * SEQ // world, (rank + 1) * SEQ // world) if sequence_parallel else slice(None)
    x = x_full[seq].clone().requires_grad_()
    hidden, _ = col(x)
    y, _ = row(hidden)
    y.backward(full["dy"].float()[seq])
    # Megatron's finalize step sums the sequence-parallel parameters' gradients over TP.
    for p in (col.lora_a, row.lora_b):
        if getattr(p, "sequence_parallel", False) and world > 1:
            dist.all_reduce(p.grad, group=group)

    def gather(t, dim):
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts, dim)

    out = {
        "y": gather(y.detach(), 0) if sequence_parallel else y.detach(),
        "dx": gather(x.grad, 0) if sequence_parallel else x.grad,
        "a1": col.lora_a.detach(), "da1": col.lora_a.grad,
        "b1": gather(col.lora_b.detach(), 0), "db1": gather(col.lora_b.grad, 0),
        "a2": gather(row.lora_a.detach(), 1), "da2": gather(row.lora_a.grad, 1),
        "b2": row.lora_b.detach(), "db2": row.lora_b.grad,
        "base_grads": [p.grad for p in (col.weight, row.weight)],
        "trainable": sorted(f"{prefix}.{name}" for module, prefix in ((col, "col"), (row, "row"))
                            for name, p in module.named_parameters() if p.requires_grad),
    }  # fmt: skip
    return out


def _reference(a1, b1, a2, b2, *, zero_b: bool) -> dict[str, torch.Tensor]:
    """float64: both layers with their adapters written out, autograd for the gradients."""
    full = _full_tensors()
    scale = ALPHA / RANK
    a1, a2 = a1.double().requires_grad_(), a2.double().requires_grad_()
    b1 = (torch.zeros_like(full["b1"]) if zero_b else full["b1"]).clone().requires_grad_()
    b2 = (torch.zeros_like(full["b2"]) if zero_b else full["b2"]).clone().requires_grad_()
    x = full["x"].clone().requires_grad_()
    hidden = x @ full["w1"].t() + scale * (x @ a1.t()) @ b1.t()
    y = hidden @ full["w2"].t() + scale * (hidden @ a2.t()) @ b2.t()
    y.backward(full["dy"])
    return {"y": y, "dx": x.grad, "da1": a1.grad, "db1": b1.grad, "da2": a2.grad, "db2": b2.grad}


@pytest.fixture(scope="module")
def layouts():
    """(TP, sequence parallel, B zero) -> rank 0's report."""
    return dict(run_on_ranks(_cases, 2))


@pytest.mark.parametrize("case", [(1, False, False), (2, False, False), (2, True, False)], ids=["tp1", "tp2", "tp2_sp"])
def test_outputs_and_adapter_gradients_equal_a_float64_reference(layouts, case):
    got = layouts[case]
    ref = _reference(got["a1"], got["b1"], got["a2"], got["b2"], zero_b=False)
    for key, want in ref.items():
        assert torch.allclose(got[key].double(), want, rtol=1e-5, atol=1e-5), (
            case,
            key,
            (got[key].double() - want).abs().max(),
        )


def test_every_layout_holds_the_same_adapter_a(layouts):
    one = layouts[1, False, False]
    for case in [(2, False, False), (2, True, False)]:
        assert torch.equal(layouts[case]["a1"], one["a1"]) and torch.equal(layouts[case]["a2"], one["a2"]), case
    assert one["a1"].abs().max() > 0  # drawn, not left zero


def test_only_the_adapters_train_and_b_zero_is_the_base_model(layouts):
    for report in (layouts[case] for case in CASES):
        assert report["base_grads"] == [None, None]
        assert report["trainable"] == ["col.lora_a", "col.lora_b", "row.lora_a", "row.lora_b"]
    zero = layouts[2, False, True]
    full = _full_tensors()
    base = (full["x"] @ full["w1"].t()) @ full["w2"].t()
    assert torch.allclose(zero["y"].double(), base, rtol=1e-6, atol=1e-6)
    # B = 0: A gets no gradient yet, B does (the first step moves B only)
    assert zero["da1"].abs().max() == 0 and zero["db1"].abs().max() > 0


def test_with_lora_puts_adapters_on_the_named_linears_of_the_layer_spec():
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_rl.models import adapter_for_config
    from megatron_rl.models.lora import (
        TARGET_MODULES,
        LoRAColumnParallelLinear,
        LoRARowParallelLinear,
        LoRASettings,
        _submodules,
        with_lora,
    )

    base = adapter_for_config(QWEN2).layer_spec(QWEN2, use_te=False)
    lora = LoRASettings(rank=4, alpha=8.0, target_modules=("linear_qkv", "linear_fc2"))
    spec = with_lora(base, lora)
    attn, mlp = (_submodules(b) for b in (spec.submodules.self_attention, spec.submodules.mlp))
    assert attn.linear_qkv.module is LoRAColumnParallelLinear and attn.linear_qkv.params["lora"] == lora
    assert mlp.linear_fc2.module is LoRARowParallelLinear
    assert attn.linear_proj is _submodules(base.submodules.self_attention).linear_proj  # not a target: untouched
    assert _submodules(base.submodules.self_attention).linear_qkv is ColumnParallelLinear  # the input is not changed
    every = with_lora(base, replace(lora, target_modules=TARGET_MODULES))
    assert _submodules(every.submodules.mlp).linear_fc1.module is LoRAColumnParallelLinear
    with pytest.raises(ValueError, match="unknown LoRA target modules"):
        with_lora(base, replace(lora, target_modules=("q_proj",)))
    fused = with_lora(base, replace(lora, target_modules=()))
    _submodules(fused.submodules.self_attention).linear_qkv = ModuleSpec(module=torch.nn.Linear)
    with pytest.raises(ValueError, match="needs megatron's local linear layers"):
        with_lora(fused, replace(lora, target_modules=("linear_qkv",)))


def test_a_gpt_model_with_adapters_starts_as_the_base_model(layouts):
    """TP = 2: the LoRA spec's GPTModel with the base model's weights (B = 0) gives its
    logits exactly; its only trainable parameters are the 2 layers x 4 linears' A and B."""
    gpt = layouts["gpt"]
    assert gpt["adapted"] == 8 and gpt["unexpected"] == []
    assert gpt["missing"] == gpt["trainable"] and len(gpt["trainable"]) == 16
    assert all(n.endswith((".lora_a", ".lora_b")) for n in gpt["trainable"])
    assert torch.equal(gpt["logits"]["lora"], gpt["logits"]["base"])


# ----------------------------------------------------------------------------- the LoRA actor
# tests/helpers/lora_actor_checks.py, inside the 4-rank actor job (tests/distributed/conftest.py):
# a Qwen2 actor with rank-4 adapters on every linear, the base weights loaded, two RL steps.

ACTOR_TOL = 1e-5


@pytest.fixture(scope="module")
def lora_actor(actor_job) -> dict:
    return actor_job["r0"]["lora"]


def test_lora_actor_layouts_give_the_same_steps_and_merged_weights(lora_actor):
    layouts = lora_actor["layouts"]
    ref = layouts["tp1_pp1"]
    for key, entry in layouts.items():
        for step in ("step1", "step2"):
            for name in ("loss/total", "actor/grad_norm"):
                got, want = entry[step][name], ref[step][name]
                assert abs(got - want) <= ACTOR_TOL * max(1.0, abs(want)), (key, step, name, got, want)
            assert entry[step]["actor/step_skipped"] == 0.0
        assert entry["merged_vs_tp1"] <= ACTOR_TOL, key
        assert entry["logp_vs_tp1"] <= ACTOR_TOL, key
        # The adapters trained (B left zero) and moved the policy well above the tolerance.
        assert entry["adapter_b_abs_max"] > 1e-3 and entry["logp_moved"] > 100 * ACTOR_TOL, key


def test_only_the_adapters_train_and_the_base_weights_stay_bit_identical(lora_actor, actor_job):
    from megatron_rl.cluster.planner import Architecture, lora_parameters
    from megatron_rl.config.trainer import LoRAConfig

    arch = Architecture.from_hf_config(
        json.loads((Path(actor_job["spec"]["variants"]["qwen2_gqa"]["hf_dir"]) / "config.json").read_text())
    )
    for key, entry in lora_actor["layouts"].items():
        tp, pp = int(key[2]), int(key[6])
        # The planner's count of a rank's adapter parameters is the model's.
        assert entry["adapter_elements"] == lora_parameters(arch, LoRAConfig(rank=4), tp=tp, pp=pp), key
        # 2 layers x 4 linears x (A, B), every rank of every layout holds its shards of all.
        assert entry["num_adapter_params"] in (16, 8), key  # PP = 2: one layer per stage
        assert entry["trainable_are_adapters"] and entry["ddp_params_are_adapters"], key
        assert entry["base_bit_identical"], key
        assert entry["loaded_optimizer"] is False  # a base checkpoint: nothing of its optimizer fits


def test_reference_with_adapters_off_is_the_initial_policy(lora_actor):
    for key, entry in lora_actor["layouts"].items():
        assert entry["reference_equals_actor_at_init"], key  # B = 0: the LoRA model is the base model
        assert entry["reference_vs_initial"] == 0.0, key  # after training too: the base is frozen


def test_the_merged_export_in_transformers_gives_the_lora_actors_logprobs(lora_actor):
    assert lora_actor["merged_export_vs_actor"] <= 1e-4


def test_lora_checkpoints_resume_exactly_reshard_and_are_refused_without_adapters(lora_actor):
    from megatron_rl.config.trainer import LoRATarget

    resume = lora_actor["resume"]
    assert resume["loaded_optimizer"] is True
    assert resume["lora_record"] == {"rank": 4, "alpha": 8.0, "target_modules": list(typing.get_args(LoRATarget))}
    for name in ("loss/total", "actor/grad_norm"):
        assert resume["step2"][name] == resume["step2_continuous"][name], name
    assert resume["merged_bit_identical"]
    reshard = lora_actor["reshard_tp2_to_tp1"]
    assert reshard["logp_vs_saved"] <= ACTOR_TOL
    assert reshard["refusal"] is not None and "holds LoRA adapters" in reshard["refusal"]


def test_a_lora_checkpoint_over_base_weights_from_a_file_holds_the_adapters_only(lora_actor, actor_job):
    """The actor loaded its base from the converted checkpoint (HF safetensors at PP = 2): its
    checkpoints hold the adapters and their optimizer state only, name that base with a
    fingerprint, and load only over it (the resume above: bit for bit); without a base, or
    over other files (the same weights as HF safetensors), they are refused naming both."""
    variant = actor_job["spec"]["variants"]["qwen2_gqa"]
    for key, entry in lora_actor["layouts"].items():
        want = variant["hf_dir"] if key == "tp2_pp2" else variant["mcore_dir"]
        assert entry["base_weights"] == str(Path(want).absolute()), key
    only = lora_actor["adapter_only"]
    assert only["record"]["path"] == str(Path(variant["mcore_dir"]).absolute()) and len(only["record"]["fingerprint"]) == 64
    assert only["model_keys_are_adapters"]
    refusals = lora_actor["resume"]["refusals"]
    assert "holds LoRA adapters only, trained over the base weights of " + only["record"]["path"] in refusals["no_base"]
    assert "this model holds no base weights loaded" in refusals["no_base"]
    assert f"this model holds the base weights of {Path(variant['hf_dir']).absolute()}" in refusals["other_base"]



def test_the_config_names_the_linears_the_layer_spec_knows():
    from megatron_rl.config.trainer import LoRAConfig, LoRATarget
    from megatron_rl.models.lora import TARGET_MODULES

    assert typing.get_args(LoRATarget) == TARGET_MODULES
    assert tuple(LoRAConfig().target_modules) == TARGET_MODULES


def test_convert_writes_the_merged_model_and_a_peft_adapter_that_reproduce_the_actor(lora_actor):
    """``megatron-rl convert mcore-to-hf --out M --peft-out P`` of the TP=2 LoRA checkpoint: M in
    transformers and P loaded by ``peft`` over the HF base model give the actor's log-probs at
    that checkpoint; M's adapted projections are the base weights plus ``(alpha / r) B A`` of
    P's tensors, every other tensor the base's bit for bit."""
    convert = lora_actor["convert"]
    assert convert["exit"] == 0, convert["output"]
    assert convert["merged_vs_actor"] <= ACTOR_TOL and convert["peft_vs_actor"] <= ACTOR_TOL, convert
    config = convert["peft_config"]
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["task_type"]) == ("LORA", 4, 8.0, "CAUSAL_LM")
    projections = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert config["target_modules"] == projections
    assert convert["adapted_projections"] == 2 * len(projections) and convert["peft_tensors"] == 4 * len(projections)
    assert convert["merged_vs_base_plus_ba"] <= 1e-6 and convert["unadapted_equal"], convert
    # The TP=2 x PP=2 actor's checkpoint, adapter-only over HF safetensors: merged from there.
    assert isinstance(convert["over_hf_base_vs_tp1"], float), convert["over_hf_base_vs_tp1"]
    assert convert["over_hf_base_vs_tp1"] <= ACTOR_TOL
