"""Actor train-step throughput and MFU for a ~1B-parameter random-init Qwen2 model.

Builds ``MegatronActor`` from an inline Qwen2 config (no weights are read: megatron's
random init), makes a batch of ``--sequences`` x ``--seq-len`` tokens (all real, the last
``--response-len`` trained on), runs one warm-up ``train_step`` and then ``--steps`` timed
ones, and prints ONE JSON line (rank 0) with tokens/s, seconds per step, the model FLOPs
per step and MFU against the GPU's dense bf16 peak.

FLOPs per step (dense decoder, forward + backward = 3x forward, Megatron-LM's formula
without activation recomputation): ``6 * N_matmul * T + 6 * num_layers * s * h_attn * T``
where ``N_matmul`` counts the parameters of the matrix multiplies (layers + output
layer, not the embedding lookup), ``T`` the tokens of the step, ``s`` the sequence
length and ``h_attn`` the query width (causal attention counted at half the square).

    torchrun --nproc_per_node 8 benchmarks/actor_throughput.py --tp 2        # GPU
    python benchmarks/actor_throughput.py --tiny                             # CPU smoke run

On a machine without CUDA only ``--tiny`` runs (a 1B model on CPU takes minutes per
step); MFU is ``null`` when the device's peak is unknown (CPU included).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

# Dense bf16 tensor-core peak per GPU (FLOP/s), by device-name substring.
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "B200": 2250e12}

QWEN2_1B = {
    "model_type": "qwen2",
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "vocab_size": 151_936,
    "max_position_embeddings": 8192,
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
}
QWEN2_TINY = {**QWEN2_1B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 250, "max_position_embeddings": 512}  # fmt: skip


def matmul_params(cfg: dict) -> int:
    """Parameters that take part in matrix multiplies (layers + output layer)."""
    h, f, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    head = h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head, cfg["num_key_value_heads"] * head
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * f
    return layers * per_layer + cfg["vocab_size"] * h


def step_flops(cfg: dict, tokens: int, seq_len: int) -> float:
    h_attn = cfg["num_attention_heads"] * (cfg["hidden_size"] // cfg["num_attention_heads"])
    return 6.0 * matmul_params(cfg) * tokens + 6.0 * cfg["num_hidden_layers"] * seq_len * h_attn * tokens


def _init_single_process() -> None:
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny model, CPU-friendly sizes (smoke run)")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--sequences", type=int, default=None, help="sequences per step (default 64; tiny 8)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 2048; tiny 64)")
    parser.add_argument("--response-len", type=int, default=None, help="trained tokens per sequence (default 3/4)")
    parser.add_argument("--max-tokens-per-microbatch", type=int, default=None, help="default 16384; tiny 256")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float32"], help="default bf16 (tiny: fp32)")
    parser.add_argument("--fp8", default=None, choices=["e4m3", "hybrid"])
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available() and not args.tiny:
        print("error: no CUDA device; a 1B model on CPU is impractical -- run with --tiny", file=sys.stderr)
        return 2
    cfg = QWEN2_TINY if args.tiny else QWEN2_1B
    sequences = args.sequences or (8 if args.tiny else 64)
    seq_len = args.seq_len or (64 if args.tiny else 2048)
    response = args.response_len or (seq_len * 3 // 4)
    budget = args.max_tokens_per_microbatch or (256 if args.tiny else 16384)
    dtype = args.dtype or ("float32" if args.tiny else "bfloat16")

    if "RANK" not in os.environ:
        _init_single_process()
    import torch.distributed as dist

    from megatron_rl.actor.actor import MegatronActor
    from megatron_rl.actor.batch import ActorBatch
    from megatron_rl.actor.launch import init_process_group
    from megatron_rl.actor.spec import ActorSpec
    from megatron_rl.algo import AlgorithmConfig
    from megatron_rl.config.model import ModelOptions
    from megatron_rl.config.parallel import ParallelConfig
    from megatron_rl.config.trainer import TrainerConfig

    init_process_group()
    actor = MegatronActor(
        ActorSpec(
            architecture=cfg,
            parallel=ParallelConfig(
                num_actor_ranks=dist.get_world_size(),
                tensor_model_parallel_size=args.tp,
                pipeline_model_parallel_size=args.pp,
            ),
            model=ModelOptions(dtype=dtype, fp8=args.fp8),
            trainer=TrainerConfig(lr=1e-6, max_tokens_per_microbatch=budget),
            algorithm=AlgorithmConfig(kl_coef=0.0),
        )
    )
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg["vocab_size"], (sequences, seq_len), generator=g)
    attn = torch.ones(sequences, seq_len, dtype=torch.long)
    loss_mask = attn.clone()
    loss_mask[:, : seq_len - response] = 0
    start = time.perf_counter()
    old = actor.compute_logprobs(ActorBatch(input_ids=ids, attention_mask=attn)).logp
    logprob_s = time.perf_counter() - start
    advantages = torch.randn(sequences, seq_len, generator=g)
    batch = ActorBatch(input_ids=ids, attention_mask=attn, loss_mask=loss_mask, old_logp=old, advantages=advantages)
    actor.train_step(batch)  # warm-up
    times = []
    for _ in range(args.steps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        dist.barrier()
        t = time.perf_counter()
        metrics = actor.train_step(batch)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    step_s = statistics.median(times)
    tokens = sequences * seq_len
    flops = step_flops(cfg, tokens, seq_len)
    world = dist.get_world_size()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    peak = next((v for k, v in PEAK_BF16.items() if k in device), None) if dtype == "bfloat16" else None
    result = {
        "benchmark": "actor_throughput",
        "model": "qwen2-tiny" if args.tiny else "qwen2-1b",
        "params": matmul_params(cfg) + (0 if cfg["tie_word_embeddings"] else cfg["vocab_size"] * cfg["hidden_size"]),
        "device": device,
        "world_size": world,
        "tp": args.tp,
        "pp": args.pp,
        "dp": world // (args.tp * args.pp),
        "dtype": dtype,
        "fp8": args.fp8,
        "sequences": sequences,
        "seq_len": seq_len,
        "microbatches_total": metrics["actor/num_microbatches"],
        "step_s_median": step_s,
        "step_s_all": times,
        "tokens_per_s": tokens / step_s,
        "tokens_per_s_per_rank": tokens / step_s / world,
        "model_tflops_per_step": flops / 1e12,
        "mfu": (flops / step_s / world / peak) if peak else None,
        "compute_logprobs_s": logprob_s,
        "loss": metrics["loss/total"],
        "peak_gpu_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
    }
    if dist.get_rank() == 0:
        print(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
