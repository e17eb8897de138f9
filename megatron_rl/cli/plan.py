"""``megatron-rl plan CONFIG [overrides] --gpu-memory-gb 80``: the actor's memory per GPU.

Prints, per component, the bytes one GPU of the run's worst pipeline stage needs
(``megatron_rl.cluster.planner``) and the total against the GPU memory; exit code 1 when it does
not fit, 2 for a bad config. ``--json`` prints the plan as JSON instead. The architecture
comes from ``model.hf_config`` (a ``config.json`` is enough: no weights are read).
"""

from __future__ import annotations

import argparse
import json
import sys

from megatron_rl.cli import EXIT_FAILURE, EXIT_OK


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", metavar="CONFIG", help="run config YAML file (see docs/config.md)")
    parser.add_argument("overrides", nargs="*", metavar="section.field=value", help="override config fields")
    parser.add_argument("--gpu-memory-gb", type=float, default=None, help="GPU memory in GiB to check against")
    parser.add_argument("--use-te", choices=("auto", "yes", "no"), default=None,
                        help="plan for the Transformer-Engine spec (fused attention) or the local spec (no: what "
                             "CPU runs use); default: the spec a GPU run uses, Transformer Engine's unless "
                             "actor.lora (adapters sit on the local spec's linears)")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def _fmt(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 30):8.2f} GiB"


def run(args: argparse.Namespace) -> int:
    from megatron_rl.actor.model import te_available
    from megatron_rl.cluster.planner import Architecture, plan_memory
    from megatron_rl.config.run import load_run_config

    config = load_run_config(args.config, args.overrides)
    arch = Architecture.of_model(config.model)
    lora = config.actor.lora is not None
    if args.use_te == "yes" and lora:
        print("error: --use-te yes: a LoRA actor (actor.lora) uses the local spec; plan it with --use-te no",
              file=sys.stderr)  # fmt: skip
        return EXIT_FAILURE
    use_te = {"yes": True, "no": False, "auto": te_available() and not lora, None: not lora}[args.use_te]
    gpu = int(args.gpu_memory_gb * (1 << 30)) if args.gpu_memory_gb is not None else None
    plan = plan_memory(
        arch, parallel=config.parallel, model=config.model, trainer=config.trainer, actor=config.actor,
        rollout=config.rollout, with_reference=config.algorithm.needs_ref_logp, use_te=use_te, gpu_memory_bytes=gpu,
    )  # fmt: skip
    if args.json:
        print(json.dumps(plan.as_dict(), indent=2))
    else:
        par = config.parallel
        experts = (f"; experts EP {par.expert_model_parallel_size} x ETP {par.resolved_expert_tensor_parallel_size}"
                   if arch.is_moe else "")  # fmt: skip
        print(
            f"per GPU, pipeline stage {plan.stage} of {par.pipeline_model_parallel_size} "
            f"(TP {par.tensor_model_parallel_size} x PP {par.pipeline_model_parallel_size} x "
            f"DP {par.resolved_data_parallel_size}{experts}, {config.model.dtype}, loss {config.actor.loss_impl}, "
            f"recompute {config.actor.recompute_granularity})"
        )
        for name, value in plan.components.items():
            print(f"  {name:<28}{_fmt(value)}")
        # not the sum: the forward-backward's transients and the optimizer step's never coexist
        print(f"  {'training peak':<28}{_fmt(plan.training_bytes)}  (resident + the larger phase's transients)")
        print(f"  {'weight sync total':<28}{_fmt(plan.sync_bytes)}  (rank 0; the sync adds "
              f"{_fmt(plan.sync_transient_bytes).strip()})")  # fmt: skip
        print(f"  {'generation total':<28}{_fmt(plan.generation_bytes)}")
        if gpu is not None:
            verdict = "fits" if plan.fits else "does NOT fit"
            print(f"peak {_fmt(plan.total_bytes).strip()} of {args.gpu_memory_gb:g} GiB: {verdict}")
        for note in plan.notes:
            print(f"note: {note}")
    if plan.fits is False:
        print("error: the plan does not fit the GPU memory", file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_OK
