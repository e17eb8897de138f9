"""The LoRA actor's checks, run inside tests/helpers/actor_worker.py's 4-rank job (its
ranks, batch and base model): reported under ``report["lora"]`` for
tests/distributed/test_lora.py.

At TP=1 x DP=4, TP=2 (sequence parallel) x DP=2 and TP=2 x PP=2, a Qwen2 actor with
rank-4 adapters on every linear of its layers, loaded with the base weights, runs the same
two steps as the full-parameter layouts (GRPO+KL+entropy, then AR+Lopti+STAPO). Reported:
the step metrics and merged HF weights (to compare across layouts), which parameters train
(megatron DDP's buffers), whether every base weight is bit-identical after the steps, the
reference policy (adapters off) against the actor at initialisation (B = 0) and after the
steps, a transformers forward of the merged export against the actor's own log-probs, and
checkpoints: resume at the same layout, a TP=2 LoRA checkpoint at TP=1, and a LoRA
checkpoint refused by a model without adapters.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

LAYOUTS = [(1, 1, False), (2, 1, True), (2, 2, False)]
RANK, ALPHA = 4, 8.0


def run_lora_checks(*, build, base, rl_batch, algorithms, variant_paths, work: Path, hf_reference, hf_weights,
                    max_diff, temperature: float) -> dict:  # fmt: skip
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    from megatron_rl.actor.reference import AdaptersOffReference
    from megatron_rl.actor.weights import global_parameters
    from megatron_rl.config.trainer import ActorConfig, LoRAConfig
    from megatron_rl.models.lora import ADAPTER_SUFFIXES

    first, second = algorithms
    lora = ActorConfig(lora=LoRAConfig(rank=RANK, alpha=ALPHA))
    report: dict = {"layouts": {}}
    merged, logps_after, initial = {}, {}, {}
    for tp, pp, sp in LAYOUTS:
        key = f"tp{tp}_pp{pp}" + ("_sp" if sp else "")
        actor = build("qwen2_gqa", tp, pp, actor=lora, sequence_parallel=sp)
        if pp == 2:  # straight from HF safetensors; the others from the converted (base) checkpoint
            actor.load_hf_weights(variant_paths["hf_dir"])
            loaded = {"loaded_optimizer": False}
        else:
            loaded = actor.load_checkpoint(variant_paths["mcore_dir"])
        model = actor.model
        adapters = {id(p) for name, p in model.named_parameters() if name.endswith(ADAPTER_SUFFIXES)}
        in_ddp = {id(p) for b in actor.ddp.buffers + actor.ddp.expert_parallel_buffers for p in b.params}
        base_before = {n: p.detach().clone() for n, p in global_parameters(model, actor.adapter).items()}
        logp0 = actor.compute_logprobs(base, temperature=temperature).logp
        reference = AdaptersOffReference(actor)
        entry = {
            "base_weights": (actor.base_weights or {}).get("path"),
            "loaded_optimizer": loaded["loaded_optimizer"],
            "num_adapter_params": len(adapters),
            "adapter_elements": sum(p.numel() for p in model.parameters() if id(p) in adapters),
            "trainable_are_adapters": {id(p) for p in model.parameters() if p.requires_grad} == adapters,
            "ddp_params_are_adapters": in_ddp == adapters,
            "reference_equals_actor_at_init": bool(
                torch.equal(reference.compute_logprobs(base, temperature=temperature).logp, logp0)
            ),
        }
        initial[key] = logp0
        batch = rl_batch(initial["tp1_pp1"])
        entry["step1"] = actor.train_step(batch, algorithm=first)
        if key == "tp2_pp1_sp":
            actor.save_checkpoint(work / "lora_ckpt" / "step_1")
            saved_logp = actor.compute_logprobs(base, temperature=temperature).logp
        entry["step2"] = actor.train_step(batch, algorithm=second, phase="low")
        if key == "tp2_pp2":  # adapter-only over the HF safetensors (convert reads its base from there)
            actor.save_checkpoint(work / "lora_ckpt_hf" / "step_2")
        after = global_parameters(model, actor.adapter)
        entry["base_bit_identical"] = sorted(after) == sorted(base_before) and all(
            torch.equal(after[n], base_before[n]) for n in after
        )
        entry["adapter_b_abs_max"] = max(
            float(p.detach().abs().max()) for n, p in model.named_parameters() if n.endswith(".lora_b")
        )
        logp = actor.compute_logprobs(base, temperature=temperature).logp
        entry["logp_moved"] = float((logp - logp0).abs().max())
        entry["reference_vs_initial"] = float(
            (reference.compute_logprobs(base, temperature=temperature).logp - logp0).abs().max()
        )
        merged[key], logps_after[key] = hf_weights(actor), logp
        report["layouts"][key] = entry

    ref_key = "tp1_pp1"
    for key in merged:
        report["layouts"][key]["merged_vs_tp1"] = max_diff(merged[key], merged[ref_key])
        report["layouts"][key]["logp_vs_tp1"] = float((logps_after[key] - logps_after[ref_key]).abs().max())

    # The merged export is a plain HF model: transformers gives the LoRA actor's log-probs.
    export = work / "lora_merged_hf"
    if dist.get_rank() == 0:
        export.mkdir(parents=True, exist_ok=True)
        shutil.copy(Path(variant_paths["hf_dir"]) / "config.json", export / "config.json")
        save_file({k: v.contiguous() for k, v in merged[ref_key].items()}, str(export / "model.safetensors"))
        hf_logp, _ = hf_reference(str(export), base)
        real = base.attention_mask.bool().clone()
        real[:, 0] = False
        report["merged_export_vs_actor"] = float((hf_logp - logps_after[ref_key].double())[real].abs().max())
        report["convert"] = _convert_checks(work, variant_paths["hf_dir"], hf_reference, base, saved_logp, real)
        report["convert"]["over_hf_base_vs_tp1"] = _convert_over_hf_base(work, merged[ref_key], max_diff)
    dist.barrier()

    # The checkpoint over the converted base holds the adapters (and their optimizer state) only.
    saved = work / "lora_ckpt" / "step_1"
    if dist.get_rank() == 0:
        from torch.distributed.checkpoint import FileSystemReader

        keys = sorted(FileSystemReader(str(saved)).read_metadata().state_dict_metadata)
        model_keys = [k for k in keys if k.startswith(("embedding.", "decoder.", "output_layer."))]
        report["adapter_only"] = {
            "record": json.loads((saved / "actor_state.json").read_text()).get("base_weights"),
            "model_keys_are_adapters": bool(model_keys) and all(k.endswith(ADAPTER_SUFFIXES) for k in model_keys),
        }

    # Resume at the saved layout: refused without the base, and over another base; over its
    # base, the second step again, bit for bit.
    actor = build("qwen2_gqa", 2, 1, actor=lora, sequence_parallel=True)
    refusals = {}
    for case, base_dir in (("no_base", None), ("other_base", variant_paths["hf_dir"])):
        if base_dir is not None:
            actor.load_hf_weights(base_dir)
        try:
            actor.load_checkpoint(work / "lora_ckpt")
            refusals[case] = None
        except ValueError as e:
            refusals[case] = str(e)
    actor.load_checkpoint(variant_paths["mcore_dir"])
    record = actor.load_checkpoint(work / "lora_ckpt")
    step2 = actor.train_step(rl_batch(initial["tp1_pp1"]), algorithm=second, phase="low")
    report["resume"] = {
        "loaded_optimizer": record["loaded_optimizer"],
        "lora_record": record.get("lora"),
        "step2": step2,
        "step2_continuous": report["layouts"]["tp2_pp1_sp"]["step2"],
        "merged_bit_identical": max_diff(hf_weights(actor), merged["tp2_pp1_sp"]) == 0.0,
        "refusals": refusals,
    }

    # The TP=2 LoRA checkpoint at TP=1 (adapters resharded): the same log-probs.
    actor = build("qwen2_gqa", 1, 1, actor=lora)
    actor.load_checkpoint(variant_paths["mcore_dir"])
    actor.load_checkpoint(work / "lora_ckpt" / "step_1")
    resharded = actor.compute_logprobs(base, temperature=temperature).logp
    # A model without adapters refuses it (the adapters would be dropped silently).
    plain = build("qwen2_gqa", 1, 1)
    try:
        plain.load_checkpoint(work / "lora_ckpt" / "step_1")
        refusal = None
    except ValueError as e:
        refusal = str(e)
    report["reshard_tp2_to_tp1"] = {"refusal": refusal, "logp_vs_saved": float((resharded - saved_logp).abs().max())}
    return json.loads(json.dumps(report))


def _convert_checks(work: Path, base_hf_dir: str, hf_reference, batch, saved_logp, real) -> dict:
    """``megatron-rl convert mcore-to-hf`` of the TP=2 LoRA checkpoint (after step 1): the merged
    model in transformers, and the PEFT adapter loaded by ``peft`` over the HF base model, each
    against the actor's log-probs at that checkpoint; the merged weights against the base
    weights plus ``(alpha / r) B A`` of the PEFT tensors."""
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    merged_dir, peft_dir = work / "lora_convert_merged", work / "lora_convert_peft"
    done = _convert(work / "lora_ckpt" / "step_1", "--out", str(merged_dir), "--peft-out", str(peft_dir))
    out: dict = {"exit": done.returncode, "output": (done.stdout + done.stderr)[-2000:]}
    if done.returncode != 0:
        return out
    want = saved_logp.double()
    merged_logp, _ = hf_reference(str(merged_dir), batch)
    out["merged_vs_actor"] = float((merged_logp - want)[real].abs().max())
    base = AutoModelForCausalLM.from_pretrained(base_hf_dir, dtype=torch.float32, attn_implementation="eager")
    peft_model = PeftModel.from_pretrained(base, str(peft_dir)).eval()
    peft_logp, _ = hf_reference(None, batch, model=peft_model)
    out["peft_vs_actor"] = float((peft_logp - want)[real].abs().max())
    out["peft_config"] = json.loads((peft_dir / "adapter_config.json").read_text())
    adapter = load_file(str(peft_dir / "adapter_model.safetensors"))
    out["peft_tensors"] = len(adapter)
    base_weights, merged_weights = load_file(str(Path(base_hf_dir) / "model.safetensors")), load_file(
        str(merged_dir / "model.safetensors"))  # fmt: skip
    scale = out["peft_config"]["lora_alpha"] / out["peft_config"]["r"]
    worst, adapted = 0.0, set()
    for name, a in adapter.items():
        if name.endswith(".lora_A.weight"):
            module = name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            b = adapter[name.replace(".lora_A.", ".lora_B.")]
            expected = base_weights[f"{module}.weight"].double() + scale * b.double() @ a.double()
            worst = max(worst, float((merged_weights[f"{module}.weight"].double() - expected).abs().max()))
            adapted.add(f"{module}.weight")
    out["merged_vs_base_plus_ba"], out["adapted_projections"] = worst, len(adapted)
    out["unadapted_equal"] = sorted(merged_weights) == sorted(base_weights) and all(
        torch.equal(merged_weights[n], t) for n, t in base_weights.items() if n not in adapted
    )
    return out


def _convert_over_hf_base(work: Path, want: dict, max_diff) -> float | str:
    """``convert mcore-to-hf --out`` of the TP=2 x PP=2 adapter-only checkpoint, whose base is
    the HF safetensors: its merged weights against TP=1's after the same two steps."""
    from safetensors.torch import load_file

    out = work / "lora_convert_over_hf"
    done = _convert(work / "lora_ckpt_hf" / "step_2", "--out", str(out))
    if done.returncode != 0:
        return (done.stdout + done.stderr)[-2000:]
    return max_diff(load_file(str(out / "model.safetensors")), want)


def _convert(checkpoint: Path, *outputs: str):
    """``megatron-rl convert mcore-to-hf --mcore CHECKPOINT OUTPUTS...`` in a process of its own."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "megatron_rl", "convert", "mcore-to-hf", "--mcore", str(checkpoint), *outputs]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)
