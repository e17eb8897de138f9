"""torchrun worker for tests/distributed/test_actor_scale.py: the actor's 14B+ features in
ONE 4-rank job (fused lm-head loss, sequence parallelism, recompute, padding, the frozen
reference policy and its offload).

Usage::

    torchrun --standalone --nproc_per_node 4 tests/helpers/actor_scale_worker.py SPEC.json OUT_DIR

``SPEC.json``: ``{"variants": {name: {"hf_dir", "mcore_dir"}}}``. Each rank writes
``OUT_DIR/rank<r>.json``. Megatron imports stay under the ``__main__`` guard.
"""

from __future__ import annotations

import os
from pathlib import Path

N, L, PROMPT = 8, 20, 5
TEMPERATURE = 0.7


def make_batch(vocab: int, *, lengths=None):
    """A padded batch of ``N`` rows of at most ``L`` tokens (``PROMPT`` of them prompt), and
    noise for the old and reference log-probs; ``lengths`` (``[N]``) replaces the random ones."""
    import torch

    from megatron_rl.actor.batch import ActorBatch

    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, vocab, (N, L), generator=g)
    drawn = torch.randint(PROMPT + 3, L + 1, (N,), generator=g)
    drawn[0] = L
    lengths = drawn if lengths is None else lengths
    attn = (torch.arange(L)[None] < lengths[:, None]).long()
    loss_mask = attn.clone()
    loss_mask[:, :PROMPT] = 0
    advantages = torch.randn(N, 1, generator=g).expand(N, L).clone()
    noise = torch.randn(2, N, L, generator=g) * 0.3
    return ActorBatch(input_ids=ids, attention_mask=attn, loss_mask=loss_mask, advantages=advantages), noise


def run(spec: dict) -> dict:
    import torch.distributed as dist

    from megatron_rl.actor.actor import MegatronActor
    from megatron_rl.actor.launch import initialize_parallel
    from megatron_rl.actor.reference import ReferencePolicy
    from megatron_rl.actor.spec import ActorSpec
    from megatron_rl.algo import AlgorithmConfig, ARConfig, LoptiConfig, STAPOConfig
    from megatron_rl.config.parallel import ParallelConfig
    from megatron_rl.config.rollout import RolloutConfig
    from megatron_rl.config.trainer import ActorConfig, TrainerConfig

    world = dist.get_world_size()
    base, noise = make_batch(250)
    # GRPO with a KL term (k3) and an entropy bonus: every gradient path of the fused op.
    kl_entropy = AlgorithmConfig(kl_coef=0.05, entropy_coef=0.01)
    methods = AlgorithmConfig(
        ar=ARConfig(alpha=0.3),
        lopti=LoptiConfig(enabled=True, eta=0.004),
        stapo=STAPOConfig(enabled=True, tau_p=0.01),
        dual_clip_c=3.0,
    )

    def make_spec(variant, tp, pp, *, sp=False, algorithm=kl_entropy, **actor) -> ActorSpec:
        return ActorSpec(
            architecture=spec["variants"][variant]["hf_dir"],
            parallel=ParallelConfig(
                num_actor_ranks=world, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                sequence_parallel=sp,
            ),
            trainer=TrainerConfig(lr=1e-3, adam_eps=1e-4, max_tokens_per_microbatch=64),
            rollout=RolloutConfig(temperature=TEMPERATURE),
            actor=ActorConfig(**actor),
            algorithm=algorithm,
        )  # fmt: skip

    thread_counts: list[int] = []

    def build(cls, s: ActorSpec):
        # Threads of this process at each (re-)initialisation of the parallel state: flat
        # when the previous layout's process groups are destroyed (actor.launch.destroy_parallel).
        thread_counts.append(len(os.listdir("/proc/self/task")))
        groups = initialize_parallel(
            tensor_model_parallel_size=s.parallel.tensor_model_parallel_size,
            pipeline_model_parallel_size=s.parallel.pipeline_model_parallel_size,
            seed=s.trainer.seed,
        )
        return cls(s, groups=groups)

    def weights(policy) -> dict:
        return dict(policy.iter_hf_weights(bucket_bytes=64 * 1024))

    def max_diff(a: dict, b: dict) -> float:
        return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)

    def rl_batch(logp, batch=base):
        from dataclasses import replace

        return replace(batch, old_logp=logp + noise[0], ref_logp=logp + noise[1])

    def train(variant, tp, pp, steps=(("kl", None),), **kw) -> dict:
        """Load the HF weights, compute log-probs, take the given steps; everything to compare."""
        s = make_spec(variant, tp, pp, **kw)
        actor = build(MegatronActor, s)
        actor.load_hf_weights(spec["variants"][variant]["hf_dir"])
        lp = actor.compute_logprobs(base)
        out = {"logp": lp.logp, "entropy": lp.entropy, "metrics": []}
        for algo, phase in steps:
            m = actor.train_step(rl_batch(lp.logp), phase=phase, algorithm=methods if algo == "methods" else None,
                                 token_grad_norms=True)  # fmt: skip
            out["metrics"].append({k: m[k] for k in ("loss/total", "actor/grad_norm")})
            out.setdefault("grad_norms", actor.last_token_grad_norms)
        out["weights"] = weights(actor)
        return out

    report: dict = {}

    # --- fused lm-head vs materialised logits: every layout, tied and untied, with/without SP.
    steps = (("kl", None), ("methods", "low"))
    cases = [("qwen2_gqa", 1, 1, False), ("qwen2_gqa", 2, 1, False), ("qwen2_gqa", 1, 2, False),
             ("qwen2_gqa", 2, 2, False), ("qwen2_gqa", 2, 1, True), ("qwen2_gqa", 2, 2, True),
             ("qwen2_tied", 1, 1, False), ("qwen2_tied", 1, 2, False), ("qwen2_tied", 2, 1, True)]  # fmt: skip
    fused_vs_logits = {}
    runs = {}
    for variant, tp, pp, sp in cases:
        key = f"{variant}_tp{tp}_pp{pp}" + ("_sp" if sp else "")
        fused = train(variant, tp, pp, steps, sp=sp, loss_impl="fused_linear")
        logits = train(variant, tp, pp, steps, sp=sp, loss_impl="logits")
        runs[key] = fused
        fused_vs_logits[key] = {
            "logp": float((fused["logp"] - logits["logp"]).abs().max()),
            "entropy": float((fused["entropy"] - logits["entropy"]).abs().max()),
            "grad_norms": float((fused["grad_norms"] - logits["grad_norms"]).abs().max()),
            "metrics": [fused["metrics"], logits["metrics"]],
            "weights": max_diff(fused["weights"], logits["weights"]),
        }
    report["fused_vs_logits"] = fused_vs_logits

    # --- sequence parallelism vs none (same TP): the same log-probs, losses and updated weights.
    report["sp_vs_no_sp"] = {
        f"tp2_pp{pp}": {
            "logp": float((runs[f"qwen2_gqa_tp2_pp{pp}_sp"]["logp"] - runs[f"qwen2_gqa_tp2_pp{pp}"]["logp"]).abs().max()),
            "metrics": [runs[f"qwen2_gqa_tp2_pp{pp}_sp"]["metrics"], runs[f"qwen2_gqa_tp2_pp{pp}"]["metrics"]],
            "weights": max_diff(runs[f"qwen2_gqa_tp2_pp{pp}_sp"]["weights"], runs[f"qwen2_gqa_tp2_pp{pp}"]["weights"]),
        }
        for pp in (1, 2)
    }

    # --- activation recompute (selective, full uniform, full block) vs none, at TP=2 x PP=2.
    recompute = {}
    plain = runs["qwen2_gqa_tp2_pp2"]
    for name, kw in (
        ("selective", dict(recompute_granularity="selective")),
        ("full_uniform", dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)),
        ("full_block", dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1)),
    ):
        r = train("qwen2_gqa", 2, 2, steps, **kw)
        recompute[name] = {"metrics": [r["metrics"], plain["metrics"]], "weights": max_diff(r["weights"], plain["weights"])}
    report["recompute"] = recompute

    # --- padding each micro-batch to a multiple of 8 / 16 / 64 changes nothing.
    padding = {}
    unpadded = runs["qwen2_gqa_tp1_pp1"]
    for multiple in (8, 16, 64):
        r = train("qwen2_gqa", 1, 1, steps, pad_tokens_to_multiple_of=multiple)
        padding[str(multiple)] = {
            "logp": float((r["logp"] - unpadded["logp"]).abs().max()),
            "metrics": [r["metrics"], unpadded["metrics"]],
            "weights": max_diff(r["weights"], unpadded["weights"]),
        }
    report["padding"] = padding

    # --- the frozen reference policy at TP=2 x PP=2.
    reference = {}
    for source in ("hf", "mcore", "random"):
        s = make_spec("qwen2_gqa", 2, 2, reference_offload=source == "hf")
        actor = build(MegatronActor, s)
        ref = ReferencePolicy(s, groups=actor.groups)
        ref.copy_weights_from(actor)
        if source == "hf":
            actor.load_hf_weights(spec["variants"]["qwen2_gqa"]["hf_dir"])
            ref.load_hf_weights(spec["variants"]["qwen2_gqa"]["hf_dir"])
        elif source == "mcore":
            actor.load_checkpoint(spec["variants"]["qwen2_gqa"]["mcore_dir"])
            ref.load_weights_checkpoint(spec["variants"]["qwen2_gqa"]["mcore_dir"])
        entry = {
            "requires_grad": any(p.requires_grad for p in ref.model.parameters()),
            "has_main_grad": any(hasattr(p, "main_grad") for p in ref.model.parameters()),
            "has_ddp_or_optimizer": hasattr(ref, "ddp") or hasattr(ref, "optimizer"),
            "resident_bytes_between_passes": ref.resident_parameter_bytes(),
            "offloaded": ref.offloaded,
        }
        at_start = actor.compute_logprobs(base).logp
        ref0 = ref.compute_logprobs(base).logp
        entry["vs_actor_at_step0"] = float((ref0 - at_start).abs().max())
        entry["resident_bytes_after_pass"] = ref.resident_parameter_bytes()
        for _ in range(2):
            actor.train_step(rl_batch(at_start))
        entry["actor_moved"] = float((actor.compute_logprobs(base).logp - at_start).abs().max())
        entry["reference_fixed"] = float((ref.compute_logprobs(base).logp - ref0).abs().max())
        if source == "hf":
            # resume: a checkpoint of the trained actor loads into the actor only.
            actor.save_checkpoint(Path(spec["work_dir"]) / "ref_resume" / "step_2")
            fresh = build(MegatronActor, s)
            fresh_ref = ReferencePolicy(s, groups=fresh.groups)
            fresh_ref.copy_weights_from(fresh)
            fresh.load_hf_weights(spec["variants"]["qwen2_gqa"]["hf_dir"])
            fresh_ref.load_hf_weights(spec["variants"]["qwen2_gqa"]["hf_dir"])
            fresh.load_checkpoint(Path(spec["work_dir"]) / "ref_resume")
            entry["resumed_reference_vs_initial"] = float((fresh_ref.compute_logprobs(base).logp - ref0).abs().max())
            entry["resumed_actor_vs_trained"] = float(
                (fresh.compute_logprobs(base).logp - actor.compute_logprobs(base).logp).abs().max()
            )
        reference[source] = entry
    report["reference"] = reference

    # --- torch AdamW's kernels (actor.optimizer_kernel) at TP=2 x DP=2 (optimizer sharded
    # over DP): the same update (4 steps), the choice kept in the parameter groups after a
    # checkpoint load, and the fused kernel really running (the profiler's op names).
    from torch.profiler import ProfilerActivity, profile

    from megatron_rl.actor.optimizer import chained, optimizer_step

    kernels = {}
    by_kernel = {k: train("qwen2_gqa", 2, 1, steps * 2, optimizer_kernel=k) for k in ("for_loop", "foreach", "fused")}
    for kernel, r in by_kernel.items():
        s = make_spec("qwen2_gqa", 2, 1, optimizer_kernel=kernel)
        actor = build(MegatronActor, s)
        actor.load_hf_weights(spec["variants"]["qwen2_gqa"]["hf_dir"])
        actor.train_step(rl_batch(actor.compute_logprobs(base).logp))
        directory = Path(spec["work_dir"]) / f"kernel_{kernel}" / "step_1"
        actor.save_checkpoint(directory)
        fresh = build(MegatronActor, s)
        fresh.load_checkpoint(directory)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            optimizer_step(fresh.optimizer, fresh.scheduler, grad_clip=1.0, loss_finite=True)
        kernels[kernel] = {
            "weights_vs_for_loop": max_diff(r["weights"], by_kernel["for_loop"]["weights"]),
            "metrics": [r["metrics"], by_kernel["for_loop"]["metrics"]],
            "groups_after_load": [(g["fused"], g["foreach"]) for opt in chained(fresh.optimizer)
                                  for g in opt.optimizer.param_groups],  # fmt: skip
            "fused_op_ran": any("_fused_adam" in e.name for e in prof.events()),
        }
    report["optimizer_kernel"] = kernels

    # --- megatron's plain optimizer (actor.use_distributed_optimizer: false) at TP=2 x PP=2
    # (one DP rank): it updates like the distributed one, resumes bit for bit, and a
    # distributed optimizer refuses its state (weights only, with a warning).
    import warnings

    work = Path(spec["work_dir"]) / "optimizer_kind"
    kind: dict = {}
    two = steps * 2
    plain_run = train("qwen2_gqa", 2, 2, two, use_distributed_optimizer=False)
    dist_run = train("qwen2_gqa", 2, 2, two)
    kind["plain_vs_distributed_weights"] = max_diff(plain_run["weights"], dist_run["weights"])
    kind["plain_vs_distributed_metrics"] = [plain_run["metrics"], dist_run["metrics"]]
    plain = make_spec("qwen2_gqa", 2, 2, use_distributed_optimizer=False)
    actor = build(MegatronActor, plain)
    actor.load_hf_weights(spec["variants"]["qwen2_gqa"]["hf_dir"])
    actor.train_step(rl_batch(actor.compute_logprobs(base).logp))
    actor.save_checkpoint(work / "step_1")
    continuous = actor.train_step(rl_batch(actor.compute_logprobs(base).logp))
    fresh = build(MegatronActor, plain)
    record = fresh.load_checkpoint(work)
    resumed = fresh.train_step(rl_batch(fresh.compute_logprobs(base).logp))
    kind["record"] = {k: record.get(k) for k in ("optimizer_sharding", "loaded_optimizer", "adam_step")}
    kind["resume_metrics"] = [{k: m[k] for k in ("loss/total", "actor/grad_norm")} for m in (resumed, continuous)]
    kind["resume_weights"] = max_diff(weights(fresh), weights(actor))
    other = build(MegatronActor, make_spec("qwen2_gqa", 2, 2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        record = other.load_checkpoint(work / "step_1")
    kind["cross_loaded_optimizer"] = record["loaded_optimizer"]
    kind["cross_warning"] = [str(w.message) for w in caught if "optimizer state does not fit" in str(w.message)]
    try:
        other.load_checkpoint(work / "step_1", load_optimizer=True)
        kind["cross_required_error"] = None
    except ValueError as exc:
        kind["cross_required_error"] = str(exc)
    report["optimizer_kind"] = kind
    report["thread_counts"] = thread_counts
    return report


if __name__ == "__main__":
    from tests.helpers.worker_main import run_worker

    run_worker(lambda spec, out_dir: run(spec))
