"""``megatron-rl plan``: per-component bytes, the fit verdict as the exit code, and the
component arithmetic on a hand-checked case."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from megatron_rl.cluster.planner import Architecture, plan_memory, stage_parameters
from megatron_rl.config.model import ModelOptions
from megatron_rl.config.parallel import ParallelConfig
from megatron_rl.config.rollout import RolloutConfig
from megatron_rl.config.run import load_run_config
from megatron_rl.config.trainer import ActorConfig, TrainerConfig

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_14B = REPO / "examples" / "kk_logic" / "ar_lopti_14b.yaml"
QWEN25_14B = REPO / "examples" / "architectures" / "qwen2.5-14b.json"
EXAMPLE_30B_A3B = REPO / "examples" / "kk_logic" / "ar_lopti_30b_a3b.yaml"
QWEN3_30B_A3B = REPO / "examples" / "architectures" / "qwen3-30b-a3b.json"


def _plan(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "megatron_rl", "plan", str(EXAMPLE_14B), f"model.hf_config={QWEN25_14B}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)


def test_the_14b_example_fits_8x80gb_and_not_40gb():
    fits = _plan("--gpu-memory-gb", "80", "--json")
    assert fits.returncode == 0, fits.stderr
    plan = json.loads(fits.stdout)
    assert plan["fits"] is True and plan["total_bytes"] <= 80 * 2**30
    assert set(plan["components_bytes"]) >= {"parameters", "gradients", "optimizer_state", "activations", "loss_buffers",
                                             "reference_policy"}  # fmt: skip
    small = _plan("--gpu-memory-gb", "40")
    assert small.returncode == 1 and "does not fit" in small.stderr and "does NOT fit" in small.stdout


def test_parameters_and_state_by_hand():
    # 2 layers, hidden 64, ffn 128, 4 heads of 16 (2 kv groups), vocab 250 -> padded 256, untied.
    arch = Architecture(hidden_size=64, ffn_hidden_size=128, num_layers=2, num_attention_heads=4, num_query_groups=2,
                        head_dim=16, vocab_size=250, tie_word_embeddings=False, qkv_bias=True)  # fmt: skip
    per_layer = 64 * (64 + 64) + (64 + 64) + 64 * 64 + 3 * 64 * 128 + 2 * 64
    total = 2 * per_layer + 2 * 256 * 64 + 64
    assert stage_parameters(arch, tp=1, pp=1, stage=0) == total
    plan = plan_memory(
        arch, parallel=ParallelConfig(), model=ModelOptions(dtype="bfloat16"), trainer=TrainerConfig(),
        actor=ActorConfig(reference_offload=True), rollout=RolloutConfig(), with_reference=True, use_te=True,
    )  # fmt: skip
    c = plan.components
    assert c["parameters"] == 2 * total and c["gradients"] == 4 * total and c["optimizer_state"] == 12 * total
    assert c["reference_policy"] == 0  # offloaded: nothing resident outside its pass
    resident = plan_memory(
        arch, parallel=ParallelConfig(), model=ModelOptions(dtype="bfloat16"), trainer=TrainerConfig(),
        actor=ActorConfig(), rollout=RolloutConfig(), with_reference=True, use_te=True,
    )  # fmt: skip
    assert resident.components["reference_policy"] == 2 * total
    assert resident.components["optimizer_step_temporaries"] == 0  # auto: the fused kernel updates in place
    for kernel in ("foreach", "for_loop"):
        unfused = plan_memory(
            arch, parallel=ParallelConfig(), model=ModelOptions(dtype="bfloat16"), trainer=TrainerConfig(),
            actor=ActorConfig(optimizer_kernel=kernel), rollout=RolloutConfig(), with_reference=True, use_te=True,
        )  # fmt: skip
        # torch's AdamW unfused: float32 temporaries the size of its parameters
        assert unfused.components["optimizer_step_temporaries"] == 4 * total


def test_moe_parameters_match_transformers_and_the_experts_state_shards_over_dp_by_ep():
    """A tiny Qwen3-MoE: the planner's parameter count equals transformers' (its experts
    fused, every tensor counted once); at EP = 2 each rank holds half the experts, whose
    Adam state the distributed optimizer shards over DP / EP ranks, the rest over DP."""
    import transformers

    from megatron_rl.cluster.planner import stage_expert_parameters
    from tests.helpers.tiny_hf import build_model

    hf = build_model("qwen3_moe", 0)
    arch = Architecture.from_hf_config(hf.config.to_dict())
    total, active = arch.parameters()
    assert isinstance(hf, transformers.PreTrainedModel) and total == sum(p.numel() for p in hf.parameters())
    e, k, h, f, layers = arch.num_experts, arch.moe_topk, arch.hidden_size, arch.moe_ffn_hidden_size, arch.num_layers
    assert total - active == (e - k) * 3 * h * f * layers
    experts = stage_expert_parameters(arch, etp=1, pp=1, ep=2)
    assert experts == layers * (e // 2) * 3 * h * f
    params = stage_parameters(arch, tp=1, pp=1, stage=0, ep=2)
    assert params == stage_parameters(arch, tp=1, pp=1, stage=0) - experts
    plan = plan_memory(
        arch, parallel=ParallelConfig(num_actor_ranks=4, expert_model_parallel_size=2), model=ModelOptions(dtype="bfloat16"),
        trainer=TrainerConfig(), actor=ActorConfig(), rollout=RolloutConfig(), with_reference=False, use_te=True,
    )  # fmt: skip
    assert plan.components["parameters"] == 2 * params
    assert plan.components["optimizer_state"] == (params - experts) * 12 // 4 + experts * 12 // 2
    # TP 2 with whole experts (expert TP 1) over EP 4: each rank holds E / 4 unsplit experts,
    # whose state is sharded over the 4 / (1 * 4) = 1 rank holding the same ones.
    parallel = ParallelConfig(num_actor_ranks=4, tensor_model_parallel_size=2, sequence_parallel=True,
                              expert_model_parallel_size=4, expert_tensor_parallel_size=1)  # fmt: skip
    plan = plan_memory(arch, parallel=parallel, model=ModelOptions(dtype="bfloat16"), trainer=TrainerConfig(),
                       actor=ActorConfig(), rollout=RolloutConfig(), with_reference=False, use_te=True)  # fmt: skip
    experts = stage_expert_parameters(arch, etp=1, pp=1, ep=4)
    assert experts == layers * (e // 4) * 3 * h * f
    params = stage_parameters(arch, tp=2, pp=1, stage=0, ep=4, etp=1)
    assert params == stage_parameters(arch, tp=2, pp=1, stage=0, ep=1, etp=1) - 3 * experts
    assert plan.components["parameters"] == 2 * params
    assert plan.components["optimizer_state"] == (params - experts) * 12 // 2 + experts * 12


def test_the_30b_a3b_example_fits_2x8x80gb():
    out = subprocess.run([sys.executable, "-m", "megatron_rl", "plan", str(EXAMPLE_30B_A3B), f"model.hf_config={QWEN3_30B_A3B}",
                          "--gpu-memory-gb", "80"], capture_output=True, text=True, cwd=REPO, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "30.53B parameters, 3.35B active per token (8 of 128 experts)" in out.stdout


def test_an_optimizer_kernel_without_torchs_adam_is_a_config_error(monkeypatch):
    from megatron_rl.actor import optimizer
    from megatron_rl.config.lib import ConfigError

    monkeypatch.setattr(optimizer, "uses_torch_adam", lambda: False)  # as with TE or Apex installed
    with pytest.raises(ConfigError, match="actor.optimizer_kernel"):
        optimizer.build_optimizer(None, TrainerConfig(), params_dtype=None, use_distributed_optimizer=True,
                                  lr_decay_steps=1, kernel="fused")  # fmt: skip


def test_lora_trains_only_the_adapters_and_the_reference_costs_nothing():
    """``actor.lora``: the adapters' parameters by hand (column-parallel: A whole, B's rows
    of this TP rank; row-parallel: A's columns, B whole); gradients and optimizer state of
    the adapters alone; no reference copy. On the 14B example (TP 4 x PP 2) that is
    over 10x less of the three than full-parameter training."""
    from megatron_rl.cluster.planner import lora_parameters
    from megatron_rl.config.trainer import LoRAConfig

    arch = Architecture(hidden_size=64, ffn_hidden_size=128, num_layers=2, num_attention_heads=4, num_query_groups=2,
                        head_dim=16, vocab_size=250, tie_word_embeddings=False)  # fmt: skip
    r, tp = 4, 2
    qkv = r * 64 + (4 + 2 * 2) * 16 // tp * r
    proj = r * (64 // tp) + 64 * r
    fc1 = r * 64 + 2 * 128 // tp * r
    fc2 = r * (128 // tp) + 64 * r
    lora = LoRAConfig(rank=r, alpha=8.0)
    assert lora_parameters(arch, lora, tp=tp, pp=1) == 2 * (qkv + proj + fc1 + fc2)
    assert lora_parameters(arch, LoRAConfig(rank=r, target_modules=["linear_proj"]), tp=tp, pp=2) == proj

    config = load_run_config(EXAMPLE_14B, [f"model.hf_config={QWEN25_14B}"])
    arch = Architecture.of_model(config.model)

    def plan(actor):
        return plan_memory(arch, parallel=config.parallel, model=config.model, trainer=config.trainer, actor=actor,
                           rollout=config.rollout, with_reference=True, use_te=True).components  # fmt: skip

    resident_reference = replace(config.actor, reference_offload=False)
    full, adapted = plan(resident_reference), plan(replace(resident_reference, lora=LoRAConfig(rank=64)))
    trained = lora_parameters(arch, LoRAConfig(rank=64), tp=4, pp=2)
    assert adapted["gradients"] == 4 * trained and adapted["reference_policy"] == 0 < full["reference_policy"]
    assert adapted["parameters"] == full["parameters"] + 2 * trained  # bf16 adapters beside the frozen base
    for name in ("gradients", "optimizer_state", "reference_policy"):
        assert full[name] > 10 * adapted[name], name


EXAMPLE_72B_LORA = REPO / "examples" / "kk_logic" / "ar_lopti_72b_lora.yaml"
QWEN25_72B = REPO / "examples" / "architectures" / "qwen2.5-72b.json"


def test_the_72b_lora_example_fits_one_node_of_8x80gb_and_is_planned_on_the_local_spec():
    """Full-parameter 72B is planned on 64 GPUs (docs/multinode.md); with LoRA one 8-GPU node
    holds the actor and its colocated engine. The plan is the local spec's (a LoRA actor's),
    not Transformer Engine's: ``--use-te yes`` is refused for it."""
    def plan(*args):
        cmd = [sys.executable, "-m", "megatron_rl", "plan", str(EXAMPLE_72B_LORA), f"model.hf_config={QWEN25_72B}", *args]
        return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)

    config = load_run_config(EXAMPLE_72B_LORA, [f"model.hf_config={QWEN25_72B}"])
    assert config.parallel.num_actor_ranks == 8 and config.rollout.num_engines * config.rollout.tensor_parallel_size == 8
    fits = plan("--gpu-memory-gb", "80", "--json")
    assert fits.returncode == 0, fits.stderr
    got = json.loads(fits.stdout)
    assert got["fits"] and got["total_bytes"] <= 80 * 2**30 and got["components_bytes"]["reference_policy"] == 0
    assert any("local spec" in n for n in got["notes"]) and any("LoRA rank 64" in n for n in got["notes"])
    assert plan("--gpu-memory-gb", "40").returncode == 1  # not on 40-GB GPUs (the weight sync alone needs more)
    refused = plan("--use-te", "yes")
    assert refused.returncode == 1 and "--use-te yes: a LoRA actor (actor.lora) uses the local spec" in refused.stderr
