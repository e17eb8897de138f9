#!/usr/bin/env python
"""LoRA against full-parameter training: train-step time and peak memory, measured side by
side, and the planner's per-GPU tables for 14B/32B/72B (JSON lines).

    python benchmarks/lora.py                      # both: the measured cases, then the plans
    python benchmarks/lora.py --measured-only      # the CPU cases (one fresh process each)
    python benchmarks/lora.py --plans-only         # the planner tables (no model is built)
    python benchmarks/lora.py --case JSON          # one measured case in this process

Measured (``benchmark: lora``): one actor rank on this machine, the same batch, each case
in a fresh process: the full-parameter actor with its KL reference as a resident second
copy (``ReferencePolicy``, what a full-parameter run holds) against LoRA actors of rank 16
and 64 on every linear with the reference as the actor with its adapters off (no copy).
Reported: the median of ``--steps`` train steps after a warm-up step (Adam's moments exist
then), the peak resident memory of the step over the memory before the model was built,
and the memory after build (weights, reference, optimizer). The shapes: ``small`` (hidden
512, 2 layers) and ``large`` (hidden 1024, 4 layers), both with the Qwen2.5 vocabulary.
On a CPU host memory is device memory, so the resident reference copy counts here.

Planned (``benchmark: lora_plan``): ``megatron-rl plan``'s numbers for the 14B example and
the 32B and 72B layouts of docs/multinode.md, full parameters (reference offloaded, as the
examples run) against LoRA ranks 16 and 64 at the same layout, and the 72B LoRA example on
one node (examples/kk_logic/ar_lopti_72b_lora.yaml). Nothing of these ran on a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from actor_memory import DEFAULT_CASE, PeakRSS, launch_case, spec_of  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHAPES = {"small": {"hidden": 512, "ffn": 1408, "layers": 2, "heads": 8, "kv_heads": 2},
          "large": {"hidden": 1024, "ffn": 2816, "layers": 4, "heads": 16, "kv_heads": 4}}  # fmt: skip
RANKS = (0, 16, 64)
"""LoRA ranks of the measured cases; 0 is full-parameter training."""


def run_case(case: dict, *, steps: int) -> dict:
    """One rank: build the actor (and, full-parameter, its reference copy), time ``steps`` train steps."""
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):  # fmt: skip
        os.environ.setdefault(key, value)
    import torch

    from megatron_rl.actor.actor import MegatronActor
    from megatron_rl.actor.batch import ActorBatch
    from megatron_rl.actor.launch import destroy_process_groups, init_process_group, initialize_parallel
    from megatron_rl.actor.reference import AdaptersOffReference, ReferencePolicy

    probe = PeakRSS()
    init_process_group()
    torch.set_num_threads(int(os.environ.get("LORA_BENCH_THREADS", "1")))
    spec = spec_of(case, 1)
    groups = initialize_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    baseline = probe.rss()
    actor = MegatronActor(spec, groups=groups)
    if case["lora_rank"]:
        reference = AdaptersOffReference(actor)
    else:
        reference = ReferencePolicy(spec, groups=actor.groups)
        reference.copy_weights_from(actor)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, case["vocab"], (case["seqs"], case["seq_len"]), generator=g)
    attn = torch.ones_like(ids)
    loss_mask = attn.clone()
    loss_mask[:, :16] = 0
    plain = ActorBatch(input_ids=ids, attention_mask=attn, loss_mask=loss_mask)
    old = actor.compute_logprobs(plain).logp
    batch = ActorBatch(input_ids=ids, attention_mask=attn, loss_mask=loss_mask, old_logp=old,
                       ref_logp=reference.compute_logprobs(plain).logp,
                       advantages=torch.randn(case["seqs"], 1, generator=g).expand_as(old).clone())  # fmt: skip
    actor.train_step(batch)  # Adam allocates its moments on the first step
    built = probe.rss()
    seconds = []
    with PeakRSS() as step:
        for _ in range(steps):
            start = time.perf_counter()
            actor.train_step(batch)
            seconds.append(time.perf_counter() - start)
    trainable = sum(p.numel() for p in actor.model.parameters() if p.requires_grad)
    report = {
        "benchmark": "lora",
        "case": case,
        "tokens_per_step": case["seq_len"] * case["seqs"],
        "trainable_parameters": trainable,
        "total_parameters": sum(p.numel() for p in actor.model.parameters()),
        "after_build_bytes": built - baseline,
        "train_step_peak_bytes": step.peak - baseline,
        "train_step_seconds_median": round(statistics.median(seconds), 4),
        "train_step_seconds": [round(s, 4) for s in seconds],
    }
    destroy_process_groups()
    return report


def measured(steps: int, seq_len: int, seqs: int) -> None:
    for shape, dims in SHAPES.items():
        for rank in RANKS:  # side by side: every rank of a shape in one sweep, one process each
            case = {**DEFAULT_CASE, **dims, "lora_rank": rank, "seq_len": seq_len, "seqs": seqs, "shape": shape,
                    "reference": "resident"}  # a KL term: full parameters hold a second copy, LoRA none
            env = {**os.environ, "LORA_BENCH_STEPS": str(steps)}
            print(json.dumps(launch_case(Path(__file__), case, world=1, benchmark="lora", timeout_s=1800, env=env)),
                  flush=True)  # fmt: skip


PLANS = {
    "14b": ("examples/kk_logic/ar_lopti_14b.yaml", "qwen2.5-14b.json", []),
    "32b": ("examples/kk_logic/ar_lopti_14b.yaml", "qwen2.5-32b.json",
            ["parallel.num_actor_ranks=32", "parallel.tensor_model_parallel_size=8", "trainer.max_tokens_per_microbatch=8192",
             "rollout.tensor_parallel_size=8", "rollout.engine_args.gpu_memory_utilization=0.4"]),
    "72b": ("examples/kk_logic/ar_lopti_14b.yaml", "qwen2.5-72b.json",
            ["parallel.num_actor_ranks=64", "parallel.tensor_model_parallel_size=8",
             "parallel.pipeline_model_parallel_size=4", "actor.recompute_granularity=full", "rollout.num_engines=8",
             "rollout.tensor_parallel_size=8", "rollout.engine_args.gpu_memory_utilization=0.4"]),
    "72b_lora_one_node": ("examples/kk_logic/ar_lopti_72b_lora.yaml", "qwen2.5-72b.json", []),
}  # fmt: skip
"""The planned runs: (config, architecture, overrides) -- docs/multinode.md's layouts."""


def plans() -> None:
    from megatron_rl.cluster.planner import Architecture, plan_memory
    from megatron_rl.config.run import load_run_config

    for name, (config_path, arch_file, overrides) in PLANS.items():
        variants = [("example", [])] if "lora" in name else \
            [("full", []), *((f"lora_r{r}", [f"actor.lora.rank={r}", "actor.reference_offload=false"]) for r in (16, 64))]  # fmt: skip
        for variant, extra in variants:
            config = load_run_config(REPO / config_path,
                                     [f"model.hf_config={REPO / 'examples' / 'architectures' / arch_file}", *overrides, *extra])  # fmt: skip
            lora = config.actor.lora is not None
            plan = plan_memory(Architecture.of_model(config.model), parallel=config.parallel, model=config.model,
                               trainer=config.trainer, actor=config.actor, rollout=config.rollout,
                               with_reference=config.algorithm.needs_ref_logp, use_te=not lora,
                               gpu_memory_bytes=80 << 30)  # fmt: skip
            print(json.dumps({"benchmark": "lora_plan", "model": name, "run": variant,
                              "gpus": config.parallel.num_actor_ranks, "spec": "local" if lora else "transformer_engine",
                              "gib": {k: round(v / 2**30, 2) for k, v in plan.components.items()},
                              "training_peak_gib": round(plan.training_bytes / 2**30, 2),
                              "peak_gib": round(plan.total_bytes / 2**30, 2), "fits_80gb": plan.fits}), flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", help="run one measured case (JSON) in this process")
    parser.add_argument("--steps", type=int, default=5, help="timed train steps per case (default 5)")
    parser.add_argument("--tokens", type=int, nargs=2, default=(512, 4), metavar=("SEQ_LEN", "SEQS"),
                        help="sequence length and sequences per step (default 512 4)")  # fmt: skip
    parser.add_argument("--measured-only", action="store_true")
    parser.add_argument("--plans-only", action="store_true")
    args = parser.parse_args(argv)
    if args.case:
        steps = int(os.environ.get("LORA_BENCH_STEPS", args.steps))
        print(json.dumps(run_case({**DEFAULT_CASE, **json.loads(args.case)}, steps=steps)), flush=True)
        return 0
    if not args.plans_only:
        measured(args.steps, *args.tokens)
    if not args.measured_only:
        plans()
    return 0


if __name__ == "__main__":
    sys.exit(main())
