"""Weight sync through the Ray object store on CPU: seconds per GB into a pool of HF engines.

A random Qwen2 (default: hidden 1024, 8 layers, FFN 2816, 16 query / 4 KV heads, vocab
32000, untied, fp32: ~0.55 GB) is saved to a temporary directory and loaded by a pool of
``--engines`` HF engines (1 CPU each). The driver then syncs the same weights, read from
``model.safetensors`` (as the actor's ``iter_hf_weights`` would yield them: full
HF-named tensors), with each ``--bucket-mb``; every sync is the real path: pack into
flat buckets, ``ray.put`` once per bucket, every engine maps it zero-copy and copies the
tensors into its parameters. The pool's first (cold) sync is reported apart; then, per
bucket size, one warm-up sync and the median of --repeats.

One JSON line per bucket size: seconds per sync, seconds per GB (10^9 bytes of payload),
GiB/s, and the driver's share (``ray.put``).

    python benchmarks/weight_sync.py
    python benchmarks/weight_sync.py --layers 16 --bucket-mb 64 512 --engines 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

import torch


def save_model(directory: str, args) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=args.vocab,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--bucket-mb", type=float, nargs="+", default=[64, 512])
    parser.add_argument("--engines", type=int, nargs="+", default=[2])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    import ray
    from safetensors import safe_open

    from megatron_rl.config import RolloutConfig
    from megatron_rl.placement import GroupPlacement
    from megatron_rl.rollout import RolloutPool
    from megatron_rl.weight_buckets import MIB, make_buckets

    with tempfile.TemporaryDirectory() as tmp:
        save_model(tmp, args)
        with safe_open(os.path.join(tmp, "model.safetensors"), "pt") as f:
            weights = [(name, f.get_tensor(name)) for name in f.keys()]
        payload = sum(t.numel() * t.element_size() for _, t in weights)
        ray.init(
            num_cpus=max(2, max(args.engines)),
            include_dashboard=False,
            log_to_driver=False,
            object_store_memory=int(2.5 * payload) + (256 << 20),
        )
        try:
            for num_engines in args.engines:
                pool = RolloutPool(RolloutConfig(num_engines=num_engines), tmp,
                                   placement=GroupPlacement.uniform(num_engines, num_cpus=1))  # fmt: skip
                # The pool's first sync is cold: the object store and the engines fault in
                # fresh pages. Reported apart; every bucket size then gets one warm-up sync.
                cold = pool.sync(make_buckets(iter(weights), int(max(args.bucket_mb) * MIB)), version=1)
                print(json.dumps({"benchmark": "weight_sync", "engines": num_engines, "case": "first_sync_cold",
                                  "bucket_mb": max(args.bucket_mb), "payload_bytes": payload,
                                  "seconds": round(cold["weight_sync/seconds"], 3),
                                  "loadavg_1min": round(os.getloadavg()[0], 2)}), flush=True)  # fmt: skip
                version = 1
                for bucket_mb in args.bucket_mb:
                    runs = []
                    for _ in range(args.repeats + 1):
                        version += 1
                        runs.append(pool.sync(make_buckets(iter(weights), int(bucket_mb * MIB)), version=version))
                    runs = runs[1:]  # warm-up
                    seconds = statistics.median(r["weight_sync/seconds"] for r in runs)
                    pack = statistics.median(r["weight_sync/put_seconds"] for r in runs)
                    print(
                        json.dumps(
                            {
                                "benchmark": "weight_sync",
                                "engines": num_engines,
                                "case": "warm",
                                "bucket_mb": bucket_mb,
                                "payload_bytes": payload,
                                "num_tensors": runs[0]["weight_sync/num_tensors"],
                                "num_buckets": runs[0]["weight_sync/num_buckets"],
                                "seconds": round(seconds, 3),
                                "seconds_per_gb": round(seconds / (payload / 1e9), 3),
                                "gib_per_s": round(payload / seconds / (1 << 30), 3),
                                "driver_put_seconds": round(pack, 3),
                                "loadavg_1min": round(os.getloadavg()[0], 2),
                            }
                        ),
                        flush=True,
                    )
                pool.shutdown()
        finally:
            ray.shutdown()


if __name__ == "__main__":
    main()
