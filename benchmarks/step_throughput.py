"""RL step throughput of the whole trainer on a fixed CPU workload (prints one JSON line).

Workload: a random-init Qwen2-architecture model of ~0.8M parameters (vocab 512,
hidden 128, 4 layers, 4 heads, 2 KV heads, MLP 352), 8 prompts x 4 samples per step,
32 new tokens at temperature 1 (no stop token, so every response is 32 tokens),
on-policy (one mini-batch, one epoch), AdamW. A step is everything: rollout, rewards,
old log-probs, the train step, and the weight sync to the engines
(``timing_s/step`` of the trainer; eval, diagnostics and checkpoints are off).

Reported: median step seconds after ``--warmup`` steps, generated tokens/s, training
tokens/s (prompt + response tokens through the train step per second of train step),
the driver's peak RSS and the resident memory of every process of the run at the end.

    python benchmarks/step_throughput.py [--steps 40] [--warmup 5]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil


def _tokenizer(directory: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size - 1)}
    vocab["<unk>"] = vocab_size - 1
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # No EOS: responses always run to max_new_tokens, so every step does the same work.
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>").save_pretrained(str(directory))


def _data(path: Path, num_rows: int, vocab_size: int) -> None:
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(num_rows):
            toks = [f"t{rng.randrange(vocab_size - 1)}" for _ in range(8)]
            f.write(json.dumps({"prompt": " ".join(toks), "ground_truth": " ".join(toks[:3])}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()

    from megatron_rl.config.run import load_run_config
    from megatron_rl.loop.pipeline import make_trainer
    from megatron_rl.observability import read_metrics

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        _tokenizer(tmp / "tok", 512)
        _data(tmp / "train.jsonl", 512, 512)
        cfg_path = tmp / "bench.yaml"
        cfg_path.write_text(
            f"""
model:
  tiny: {{model_type: qwen2, hidden_size: 128, num_layers: 4, num_attention_heads: 4,
          num_key_value_heads: 2, intermediate_size: 352, vocab_size: 512, max_position_embeddings: 64}}
  tokenizer: {tmp / 'tok'}
rollout: {{num_prompts_per_step: 8, num_samples_per_prompt: 4, temperature: 1.0,
          max_prompt_tokens: 16, max_new_tokens: 32}}
trainer: {{num_steps: {args.steps}, lr: 1.0e-3, num_minibatches_per_step: 1, num_epochs_per_step: 1,
          eval_every_steps: 0, save_every_steps: 0, output_dir: {tmp / 'runs'}, resume: never}}
data: {{train_files: [{tmp / 'train.jsonl'}], task: toy_copy, prompt_template: none, num_reward_workers: 1}}
logging: {{run_name: bench, wandb_mode: disabled, token_diagnostics: false}}
"""
        )
        cfg = load_run_config(cfg_path)
        start = time.time()
        trainer = make_trainer(cfg)
        num_params = sum(t.numel() for t in trainer.parts.actors.hf_state_dict().values())
        setup_s = time.time() - start
        trainer.run()
        # Resident memory of every process of the run (driver, actor rank, engine, reward
        # worker, Ray's own daemons), read before they are stopped.
        me = psutil.Process()
        procs = [p for p in psutil.process_iter(["create_time"]) if p.info["create_time"] >= start - 1]
        total_rss = sum(_rss(p) for p in procs) + me.memory_info().rss
        trainer.close()
        records = [r for r in read_metrics(cfg.run_dir) if r["step"] > args.warmup]

    steps = [r["timing_s/step"] for r in records]
    gen = [r["throughput/tokens_per_s"] for r in records]
    train = [r["throughput/train_tokens_per_s"] for r in records]
    parts = {k: statistics.median(r[k] for r in records) for k in records[0] if k.startswith("timing_s/")}
    print(
        json.dumps(
            {
                "bench": "step_throughput",
                "num_params": num_params,
                "prompts_x_samples": "8x4",
                "new_tokens": 32,
                "steps_measured": len(steps),
                "median_step_s": round(statistics.median(steps), 4),
                "p90_step_s": round(sorted(steps)[int(0.9 * (len(steps) - 1))], 4),
                "generated_tokens_per_s": round(statistics.median(gen), 1),
                "train_tokens_per_s": round(statistics.median(train), 1),
                "median_timing_s": {k[len("timing_s/"):]: round(v, 4) for k, v in parts.items()},
                "driver_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "all_processes_rss_bytes": total_rss,
                "setup_s": round(setup_s, 1),
                "cpu_cores": os.cpu_count(),
                "python": sys.version.split()[0],
            }
        ),
        flush=True,
    )


def _rss(p: psutil.Process) -> int:
    try:
        return p.memory_info().rss if p.pid != os.getpid() else 0
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return 0


if __name__ == "__main__":
    main()
