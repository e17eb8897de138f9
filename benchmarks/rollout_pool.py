"""Rollout throughput on CPU: one in-process HF engine and Ray pools of HF engines.

Model: a random Qwen2 of ~0.80M parameters (hidden 128, 3 layers, FFN 512, 4 query / 2 KV
heads, vocab 512, tied embeddings, fp32), saved to a temporary directory. Workload (the
default): 8 prompts of 16 tokens x 4 samples x 32 new tokens, no stop tokens, so every
sample generates exactly 32 tokens (1024 tokens per call).

Cases (one JSON line each; median of --repeats calls after one warm-up call):
  engine   in-process ``HFEngine`` with ``--threads`` torch threads: seconds per call,
           milliseconds per decode step (call time / max_new_tokens, prefill included),
           generated tokens per second
  pool     ``RolloutPool`` of E engines (1 CPU and 1 torch thread each): the same,
           including Ray dispatch and result transfer

    python benchmarks/rollout_pool.py
    python benchmarks/rollout_pool.py --num-prompts 64 --engines 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time

import torch

CONFIG = dict(
    hidden_size=128,
    intermediate_size=512,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=512,
    tie_word_embeddings=True,
)


def save_model(directory: str) -> int:
    """Save the random benchmark model; returns its parameter count."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**CONFIG))
    model.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def timed(fn, repeats: int) -> tuple[float, object]:
    fn()  # warm-up: first-call allocations, lazy imports
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def report(case: str, seconds: float, results, args, **extra) -> None:
    tokens = sum(len(c) for group in results for c in group)
    print(
        json.dumps(
            {
                "benchmark": "rollout_pool",
                "case": case,
                **extra,
                "num_prompts": args.num_prompts,
                "samples_per_prompt": args.n,
                "max_new_tokens": args.max_new_tokens,
                "prompt_tokens": args.prompt_len,
                "generated_tokens": tokens,
                "seconds_per_call": round(seconds, 4),
                "ms_per_decode_step": round(1000 * seconds / args.max_new_tokens, 2),
                "tokens_per_s": round(tokens / seconds, 1),
                "loadavg_1min": round(os.getloadavg()[0], 2),
            }
        ),
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch threads of the in-process engine")
    parser.add_argument("--engines", type=int, nargs="+", default=[1, 2], help="pool sizes to run")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()

    from megatron_rl.rollout import SamplingParams
    from megatron_rl.rollout.engines.hf import HFEngine

    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, CONFIG["vocab_size"], (args.num_prompts, args.prompt_len), generator=gen).tolist()
    params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens, seed=0)

    with tempfile.TemporaryDirectory() as tmp:
        num_params = save_model(tmp)
        print(json.dumps({"benchmark": "rollout_pool", "case": "setup", "num_params": num_params,
                          "machine": f"{platform.machine()} x{os.cpu_count()} cpus", "torch": torch.__version__}),
              flush=True)  # fmt: skip
        for threads in args.threads:
            engine = HFEngine(tmp, num_threads=threads)
            seconds, out = timed(lambda: engine.generate(prompts, params), args.repeats)
            report("engine", seconds, out, args, threads=threads)
        torch.set_num_threads(max(args.threads))

        import ray

        from megatron_rl.cluster.placement import GroupPlacement
        from megatron_rl.config.rollout import RolloutConfig
        from megatron_rl.rollout import RolloutPool

        ray.init(num_cpus=max(2, max(args.engines)), include_dashboard=False, log_to_driver=False)
        try:
            for num_engines in args.engines:
                pool = RolloutPool(RolloutConfig(num_engines=num_engines), tmp,
                                   placement=GroupPlacement.uniform(num_engines, num_cpus=1))  # fmt: skip
                seconds, out = timed(lambda: pool.generate(prompts, params), args.repeats)
                report("pool", seconds, out, args, engines=num_engines, threads_per_engine=1)
                pool.shutdown()
        finally:
            ray.shutdown()


if __name__ == "__main__":
    main()
