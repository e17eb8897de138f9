"""torchrun worker for tests/distributed/test_actor.py: every actor check in ONE 4-rank job.

Usage::

    torchrun --standalone --nproc_per_node 4 tests/helpers/actor_worker.py SPEC.json OUT_DIR

``SPEC.json``: ``{"variants": {name: {"hf_dir", "mcore_dir"}}, "work_dir"}`` (HF models and
their converted weights-only checkpoints, made by the test). Each rank writes
``OUT_DIR/rank<r>.json``; rank 0 also writes ``weights_tp2_pp1_step1.pt`` (HF state dict
after the first step at TP=2) for the converter comparison done by the test.

Megatron imports and ``init_process_group`` stay under the ``__main__`` guard: the
dist-checkpoint writer starts ``spawn`` helper processes that re-import this file.
"""

from __future__ import annotations

import time
from pathlib import Path

N, L, PROMPT = 8, 20, 5
TEMPERATURE = 0.7
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
COUNTERS = ("actor/step_skipped", "actor/skipped_steps_total", "actor/optimizer_steps_total")


def make_batch(vocab: int):
    import torch

    from megatron_rl.actor.batch import ActorBatch

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (N, L), generator=g)
    lengths = torch.randint(PROMPT + 3, L + 1, (N,), generator=g)
    lengths[0] = L  # one full-length row
    attn = (torch.arange(L)[None] < lengths[:, None]).long()
    loss_mask = attn.clone()
    loss_mask[:, :PROMPT] = 0
    advantages = torch.randn(N, 1, generator=g).expand(N, L).clone()
    noise = (torch.randn(2, N, L, generator=g) * 0.3, torch.randn(N, L, generator=g))
    return ActorBatch(input_ids=ids, attention_mask=attn, loss_mask=loss_mask, advantages=advantages), noise


def algorithms():
    from megatron_rl.algo import AlgorithmConfig, ARConfig, LoptiConfig, STAPOConfig

    # Step 1: GRPO with KL (k3) and an entropy bonus (exercises dL/dH through the fused op).
    first = AlgorithmConfig(kl_coef=0.01, entropy_coef=0.01)
    # Step 2: AR + Lopti (low pass) + STAPO (forward pre-pass + threshold over DP).
    second = AlgorithmConfig(
        ar=ARConfig(alpha=0.3),
        lopti=LoptiConfig(enabled=True, eta=0.004),
        stapo=STAPOConfig(enabled=True, tau_p=0.01, entropy_quantile=0.75),
    )
    return first, second


def hf_reference(hf_dir: str | None, batch, *, model=None) -> tuple:
    """transformers log-probs / entropies at TEMPERATURE, input-aligned like the actor's (of the
    model in ``hf_dir``, or of ``model``: e.g. a PEFT model over one)."""
    import torch
    from transformers import AutoModelForCausalLM

    if model is None:
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        logits = model(batch.input_ids, attention_mask=batch.attention_mask).logits.double() / TEMPERATURE
    logprobs = torch.log_softmax(logits, dim=-1)
    logp = torch.zeros(N, L, dtype=torch.float64)
    logp[:, 1:] = logprobs[:, :-1].gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    entropy = torch.zeros(N, L, dtype=torch.float64)
    entropy[:, 1:] = -(logprobs.exp() * logprobs).sum(-1)[:, :-1]
    return logp, entropy


def hf_nll(hf_dir: str, weights: dict, batch) -> float:
    """The float64 reference of the SFT loss: transformers' cross-entropy (temperature 1) of
    ``batch``'s ``loss_mask`` tokens under the HF state dict ``weights``, mean per token."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float64, attn_implementation="eager")
    model.load_state_dict({k: v.double() for k, v in weights.items()}, strict=True)
    with torch.no_grad():
        logits = model(batch.input_ids, attention_mask=batch.attention_mask).logits
    targets = batch.input_ids[:, 1:]
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                            reduction="none").reshape(targets.shape)  # fmt: skip
    mask = batch.loss_mask[:, 1:].bool()
    return float(nll[mask].sum() / mask.sum())


def hf_weights(actor) -> dict:
    return dict(actor.iter_hf_weights(bucket_bytes=64 * 1024))


def max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b), (sorted(set(a) ^ set(b)))[:5]
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def optimizer_state(actor) -> dict:
    """This rank's optimizer shards: fp32 main params, exp_avg, exp_avg_sq, step (clones)."""
    out = {}
    for i, opt in enumerate(actor.optimizer.chained_optimizers):
        inner = opt.optimizer
        for g, group in enumerate(inner.param_groups):
            for j, p in enumerate(group["params"]):
                state = inner.state[p]
                key = f"{i}.{g}.{j}"
                out[key + ".param"] = p.detach().clone()
                for name in ("exp_avg", "exp_avg_sq", "step"):
                    out[f"{key}.{name}"] = state[name].detach().clone().float()
    return out


def run(spec: dict, out_dir: Path) -> dict:
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from megatron_rl.actor.actor import MegatronActor
    from megatron_rl.actor.batch import ActorBatch
    from megatron_rl.actor.launch import initialize_parallel
    from megatron_rl.actor.optimizer import adam_step
    from megatron_rl.actor.spec import ActorSpec
    from megatron_rl.config.model import ModelOptions
    from megatron_rl.config.parallel import ParallelConfig
    from megatron_rl.config.rollout import RolloutConfig
    from megatron_rl.config.trainer import TrainerConfig

    rank = dist.get_rank()
    work = Path(spec["work_dir"])
    report: dict = {"layouts": {}, "timing_s": {}}
    first, second = algorithms()

    def build(variant: str, tp: int, pp: int, *, max_tokens: int = 64, model=None, actor=None,
              sequence_parallel: bool = False) -> MegatronActor:  # fmt: skip
        actor_spec = ActorSpec(
            architecture=spec["variants"][variant]["hf_dir"],
            parallel=ParallelConfig(
                num_actor_ranks=dist.get_world_size(), tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                sequence_parallel=sequence_parallel,
            ),
            **({} if actor is None else {"actor": actor}),
            trainer=TrainerConfig(
                lr=1e-3,
                # Adam divides by sqrt(v) + eps: with a tiny eps, gradients that are zero in exact
                # arithmetic (key biases) turn float rounding noise into full-size updates that
                # differ between TP layouts. A larger eps keeps the comparison about gradients.
                adam_eps=1e-4,
                max_tokens_per_microbatch=max_tokens,
            ),
            rollout=RolloutConfig(temperature=TEMPERATURE),
            model=model or ModelOptions(),
        )
        groups = initialize_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, seed=actor_spec.trainer.seed
        )
        return MegatronActor(actor_spec, groups=groups)

    base, noise = make_batch(250)
    hf_source = {}
    for variant, paths in spec["variants"].items():
        hf_source[variant] = load_file(Path(paths["hf_dir"]) / "model.safetensors")
    refs = {variant: hf_reference(paths["hf_dir"], base) for variant, paths in spec["variants"].items()}
    ref_logp, ref_entropy = refs["qwen2_gqa"]

    def rl_batch(logp: torch.Tensor) -> ActorBatch:
        # old/ref log-probs near the current ones, so ratios and KL are non-trivial.
        return ActorBatch(
            input_ids=base.input_ids,
            attention_mask=base.attention_mask,
            loss_mask=base.loss_mask,
            advantages=base.advantages,
            old_logp=logp + noise[0][0],
            ref_logp=logp + noise[0][1],
        )

    real = base.attention_mask.bool().clone()  # tokens with a prediction (not column 0, not padding)
    real[:, 0] = False
    sft_batch = ActorBatch(input_ids=base.input_ids, attention_mask=base.attention_mask, loss_mask=base.loss_mask)
    weights_step1, weights_step2, weights_step3, logps = {}, {}, {}, {}
    for tp, pp in LAYOUTS:
        key = f"tp{tp}_pp{pp}"
        start = time.perf_counter()
        actor = build("qwen2_gqa", tp, pp)
        if (tp, pp) == (2, 2):  # straight from HF safetensors; the others from the converted checkpoint
            actor.load_hf_weights(spec["variants"]["qwen2_gqa"]["hf_dir"])
            record = {"loaded_optimizer": False}
        else:
            record = actor.load_checkpoint(spec["variants"]["qwen2_gqa"]["mcore_dir"])
        entry: dict = {"dp": actor.groups.dp_size, "loaded_optimizer": record["loaded_optimizer"]}
        entry["hf_exact_after_load"] = max_diff(hf_weights(actor), hf_source["qwen2_gqa"]) == 0.0
        lp = actor.compute_logprobs(base, temperature=TEMPERATURE)
        logps[key] = lp.logp
        entry["logp_vs_hf"] = float((lp.logp.double() - ref_logp)[real].abs().max())
        entry["entropy_vs_hf"] = float((lp.entropy.double() - ref_entropy)[real].abs().max())
        entry["logp_padding_zero"] = bool((lp.logp[~real] == 0).all())
        entry["logp_sum"] = float(lp.logp.double().sum())  # equal on every rank
        batch = rl_batch(logps["tp1_pp1"])
        m1 = actor.train_step(batch, algorithm=first)
        entry["step1"] = m1
        weights_step1[key] = hf_weights(actor)
        if key == "tp2_pp1":
            if rank == 0:
                torch.save(weights_step1[key], out_dir / "weights_tp2_pp1_step1.pt")
            logp_saved = actor.compute_logprobs(base, temperature=TEMPERATURE).logp
            t = time.perf_counter()
            actor.save_checkpoint(work / "ckpt" / "step_1")
            report["timing_s"]["save"] = time.perf_counter() - t
            saved_opt = optimizer_state(actor)
            actor.spec.actor.checkpoint_optimizer_sharding = "fully_reshardable"
            t = time.perf_counter()
            actor.save_checkpoint(work / "ckpt_full" / "step_1")
            report["timing_s"]["save_fully_reshardable"] = time.perf_counter() - t
        m2 = actor.train_step(batch, algorithm=second, phase="low")
        entry["step2"] = m2
        weights_step2[key] = hf_weights(actor)
        entry["adam_step"] = adam_step(actor.optimizer)
        # Step 3: SFT (algo.sft) on the response tokens, at temperature 1 whatever the rollout's.
        entry["sft_nll_float64"] = hf_nll(spec["variants"]["qwen2_gqa"]["hf_dir"], weights_step2[key], base)
        entry["step3"] = actor.sft_step(sft_batch)
        weights_step3[key] = hf_weights(actor)
        if key == "tp1_pp2":
            # A NaN advantage on a trained token: the step must be skipped, nothing changes.
            bad = rl_batch(logps["tp1_pp1"])
            bad.advantages = bad.advantages.clone()
            bad.advantages[1, PROMPT + 1] = float("nan")
            before = hf_weights(actor)
            m_nan = actor.train_step(bad, algorithm=first)
            entry["nan_step"] = {
                "metrics": {k: m_nan[k] for k in ("loss/total", *COUNTERS)},
                "weights_unchanged": max_diff(before, hf_weights(actor)) == 0.0,
                "adam_step": adam_step(actor.optimizer),
            }
            m_after = actor.train_step(batch, algorithm=first)
            entry["after_nan_step"] = {k: m_after[k] for k in COUNTERS}
        entry["seconds"] = time.perf_counter() - start
        report["layouts"][key] = entry

    reference = "tp1_pp1"
    for key in weights_step1:
        report["layouts"][key]["weights_step1_vs_tp1_pp1"] = max_diff(weights_step1[key], weights_step1[reference])
        report["layouts"][key]["weights_step2_vs_tp1_pp1"] = max_diff(weights_step2[key], weights_step2[reference])
        report["layouts"][key]["weights_step3_vs_tp1_pp1"] = max_diff(weights_step3[key], weights_step3[reference])
        report["layouts"][key]["logp_vs_tp1_pp1"] = float((logps[key] - logps[reference]).abs().max())
    report["weights_step1_change"] = max_diff(weights_step1[reference], hf_source["qwen2_gqa"])

    # --- resume: TP=2 checkpoint -> fresh TP=2 actor -> the same second step, bit for bit.
    start = time.perf_counter()
    actor = build("qwen2_gqa", 2, 1)
    t = time.perf_counter()
    record = actor.load_checkpoint(work / "ckpt")  # through the `latest` pointer
    report["timing_s"]["load"] = time.perf_counter() - t
    loaded_opt = optimizer_state(actor)
    resume = {
        "record": {k: record.get(k) for k in ("loaded_optimizer", "train_steps", "optimizer_steps", "adam_step")},
        "optimizer_keys_equal": sorted(loaded_opt) == sorted(saved_opt),
        "optimizer_state_max_diff": max(float((loaded_opt[k] - saved_opt[k]).abs().max()) for k in saved_opt),
        "adam_step_after_load": adam_step(actor.optimizer),
        "counters": [actor.train_steps, actor.optimizer_steps, actor.skipped_steps],
        "scheduler_steps": actor.scheduler.num_steps,
    }
    m2 = actor.train_step(rl_batch(logps["tp1_pp1"]), algorithm=second, phase="low")
    resume["step2"] = m2
    resume["step2_continuous"] = report["layouts"]["tp2_pp1"]["step2"]
    resume["weights_bit_identical"] = max_diff(hf_weights(actor), weights_step2["tp2_pp1"]) == 0.0
    resume["adam_step_after_step"] = adam_step(actor.optimizer)
    resume["seconds"] = time.perf_counter() - start
    report["resume"] = resume

    # --- fully_reshardable optimizer state: saved at TP=2 x PP=1, resumed at TP=1 x PP=2.
    actor = build("qwen2_gqa", 1, 2)
    record = actor.load_checkpoint(work / "ckpt_full")
    m2 = actor.train_step(rl_batch(logps["tp1_pp1"]), algorithm=second, phase="low")
    report["reshard_optimizer_tp2_to_pp2"] = {
        "loaded_optimizer": record["loaded_optimizer"],
        "optimizer_sharding": record["optimizer_sharding"],
        "adam_step_after_step": adam_step(actor.optimizer),
        "loss": [m2["loss/total"], report["layouts"]["tp2_pp1"]["step2"]["loss/total"]],
        "grad_norm": [m2["actor/grad_norm"], report["layouts"]["tp2_pp1"]["step2"]["actor/grad_norm"]],
        "weights_vs_continuous": max_diff(hf_weights(actor), weights_step2["tp2_pp1"]),
    }

    # --- the TP=2 checkpoint at TP=1 (DP=4): weights only, identical log-probs.
    actor = build("qwen2_gqa", 1, 1)
    record = actor.load_checkpoint(work / "ckpt" / "step_1")
    lp = actor.compute_logprobs(base, temperature=TEMPERATURE)
    report["reshard_tp2_to_tp1"] = {
        "loaded_optimizer": record["loaded_optimizer"],
        "logp_max_diff": float((lp.logp - logp_saved).abs().max()),
        "counters": [actor.train_steps, actor.optimizer_steps],
    }

    # --- micro-batch count invariance at TP=2 x PP=2 (DP=1: all 8 rows on one replica).
    mb = {}
    for budget in (1000, 48):
        actor = build("qwen2_gqa", 2, 2, max_tokens=budget)
        actor.load_checkpoint(spec["variants"]["qwen2_gqa"]["mcore_dir"])
        m = actor.train_step(rl_batch(logps["tp1_pp1"]), algorithm=first)
        weights = hf_weights(actor)
        m_sft = actor.sft_step(sft_batch)
        mb[budget] = (m, weights, m_sft, hf_weights(actor))
    report["microbatches"] = {
        "counts": [mb[b][0]["actor/num_microbatches"] for b in (1000, 48)],
        "loss": [mb[b][0]["loss/total"] for b in (1000, 48)],
        "grad_norm": [mb[b][0]["actor/grad_norm"] for b in (1000, 48)],
        "weights_max_diff": max_diff(mb[1000][1], mb[48][1]),
        "sft_counts": [mb[b][2]["actor/num_microbatches"] for b in (1000, 48)],
        "sft_loss": [mb[b][2]["loss/total"] for b in (1000, 48)],
        "sft_grad_norm": [mb[b][2]["actor/grad_norm"] for b in (1000, 48)],
        "sft_weights_max_diff": max_diff(mb[1000][3], mb[48][3]),
    }

    # --- tied embeddings (Qwen2 small models): PP=2 must all-reduce the embedding gradient.
    tied = {}
    for tp, pp in ((1, 1), (1, 2)):
        actor = build("qwen2_tied", tp, pp)
        if pp == 2:  # HF loading must also fill the last stage's copy of the tied embedding
            actor.load_hf_weights(spec["variants"]["qwen2_tied"]["hf_dir"])
        else:
            actor.load_checkpoint(spec["variants"]["qwen2_tied"]["mcore_dir"])
        lp = actor.compute_logprobs(base, temperature=TEMPERATURE)
        m = actor.train_step(rl_batch(lp.logp), algorithm=first)
        tied[(tp, pp)] = (m, hf_weights(actor), lp.logp)
    report["tied"] = {
        "loss": [tied[k][0]["loss/total"] for k in tied],
        "grad_norm": [tied[k][0]["actor/grad_norm"] for k in tied],
        "weights_max_diff": max_diff(tied[(1, 1)][1], tied[(1, 2)][1]),
        "logp_max_diff": float((tied[(1, 1)][2] - tied[(1, 2)][2]).abs().max()),
        "has_lm_head": "lm_head.weight" in tied[(1, 2)][1],
        "logp_vs_hf": float((tied[(1, 2)][2].double() - refs["qwen2_tied"][0])[real].abs().max()),
    }

    # --- Qwen3 (q/k norm, head_dim != H/nh) and Llama at TP=2 x PP=2: log-probs match transformers.
    report["other_archs"] = {}
    for variant in ("qwen3", "llama"):
        actor = build(variant, 2, 2)
        actor.load_hf_weights(spec["variants"][variant]["hf_dir"])
        lp = actor.compute_logprobs(base, temperature=TEMPERATURE)
        report["other_archs"][variant] = {
            "logp_vs_hf": float((lp.logp.double() - refs[variant][0])[real].abs().max()),
            "entropy_vs_hf": float((lp.entropy.double() - refs[variant][1])[real].abs().max()),
        }

    # --- bf16 parameters (fp32 master weights in the DistributedOptimizer) at TP=2: one step.
    actor = build("qwen2_gqa", 2, 1, model=ModelOptions(dtype="bfloat16"))
    actor.load_checkpoint(spec["variants"]["qwen2_gqa"]["mcore_dir"])
    before = hf_weights(actor)
    m = actor.train_step(rl_batch(logps["tp1_pp1"]), algorithm=first)
    after = hf_weights(actor)
    report["bf16"] = {
        "loss": m["loss/total"],
        "loss_fp32": report["layouts"]["tp1_pp1"]["step1"]["loss/total"],
        "grad_norm": m["actor/grad_norm"],
        "grad_norm_fp32": report["layouts"]["tp1_pp1"]["step1"]["actor/grad_norm"],
        "dtype": str(after["lm_head.weight"].dtype),
        "weights_changed": max_diff(before, after),
    }

    # --- LoRA adapters on the same base model (tests/distributed/test_lora.py).
    from tests.helpers.lora_actor_checks import run_lora_checks

    report["lora"] = run_lora_checks(
        build=build, base=base, rl_batch=rl_batch, algorithms=(first, second), variant_paths=spec["variants"]["qwen2_gqa"],
        work=work, hf_reference=hf_reference, hf_weights=hf_weights, max_diff=max_diff, temperature=TEMPERATURE,
    )  # fmt: skip
    return report


if __name__ == "__main__":
    from tests.helpers.worker_main import run_worker

    run_worker(run)
