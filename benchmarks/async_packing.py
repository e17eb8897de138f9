"""Packed vs padded micro-batches, and synchronous vs one-step-off rollout, on a K&K-shaped
workload (mixed response lengths): whole trainer runs side by side in one invocation
(prints one JSON line per run, then a summary).

Workload: a random-init Qwen2-architecture model (vocab 64, hidden 256, 4 layers, 8
heads, 4 KV heads, MLP 704: ~3.3M parameters), 8 prompts x 4 samples per step, up to
``--max-new-tokens`` new tokens at temperature 1. The tokenizer has an end-of-sequence
token, which the random model samples about once in 64 tokens, so response lengths
spread from a few tokens to the cap (geometric, then capped), as K&K responses spread
from ~100 tokens to the 4k cap. Two mini-batches per step (two optimizer steps, like a
PPO-style update), a micro-batch budget of ``--max-tokens`` tokens. A step is
everything: rollout, rewards, old log-probs, the update, the weight sync.

Each mode is one ``Trainer`` run from the same seed (so the same prompts; the sampled
responses are the same while the weights agree) in this process, one after the other,
each after waiting for an idle machine (1-minute load average below ``--idle-load``):

- ``padded``: ``trainer.pack_sequences: false`` (every row padded to its micro-batch's longest);
- ``packed``: ``trainer.pack_sequences: true``;
- ``sync``: packed, ``rollout.placement: disaggregated`` (1 engine + 1 actor rank, each
  with half the cores: ``parallel.cpu_threads`` 1 on 2 cores, so both pairs compare
  like with like), generation then update;
- ``one_step_off``: as ``sync`` with ``rollout.max_staleness: 1``: step ``n + 1``'s batch
  is generated while the actor trains step ``n``. Both async-comparison runs use
  ``rollout.tis_cap: 2`` (the decoupled loss's correction).

Reported per run: median step and update (``timing_s/update``) seconds after
``--warmup`` steps, whole-run wall seconds (start-up to shutdown), the update's padding
fraction (``actor/padding_fraction``), mean/max response length, and for
``one_step_off`` the staleness and both sides' waiting; the summary gives the
packed/padded and one_step_off/sync ratios.

    python benchmarks/async_packing.py [--steps 12] [--warmup 3] [--modes padded packed sync one_step_off]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_trl import cpu_model, wait_idle  # noqa: E402  (the same machine description and idle wait)

VOCAB = 64


def _tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB - 2)}
    vocab["<unk>"], vocab["</s>"] = VOCAB - 2, VOCAB - 1
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>").save_pretrained(
        str(directory)
    )


def _data(path: Path, num_rows: int) -> None:
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(num_rows):
            toks = [f"t{rng.randrange(VOCAB - 2)}" for _ in range(12)]
            f.write(json.dumps({"prompt": " ".join(toks), "ground_truth": " ".join(toks[:3])}) + "\n")


MODES = ("padded", "packed", "sync", "one_step_off")


def _config(tmp: Path, mode: str, args) -> str:
    pack = mode != "padded"
    disaggregated = mode in ("sync", "one_step_off")
    rollout_extra = ", placement: disaggregated, tis_cap: 2.0" if disaggregated else ""
    if mode == "one_step_off":
        rollout_extra += ", max_staleness: 1"
    parallel = f"parallel: {{cpu_threads: {max(1, (os.cpu_count() or 2) // 2)}}}" if disaggregated else ""
    return f"""
model:
  tiny: {{model_type: qwen2, hidden_size: 256, num_layers: 4, num_attention_heads: 8,
          num_key_value_heads: 4, intermediate_size: 704, vocab_size: {VOCAB},
          max_position_embeddings: {args.max_new_tokens + 32}}}
  tokenizer: {tmp / 'tok'}
rollout: {{num_prompts_per_step: 8, num_samples_per_prompt: 4, temperature: 1.0,
          max_prompt_tokens: 16, max_new_tokens: {args.max_new_tokens}{rollout_extra}}}
{parallel}
trainer: {{num_steps: {args.steps}, lr: 1.0e-4, num_minibatches_per_step: 2, num_epochs_per_step: 1,
          max_tokens_per_microbatch: {args.max_tokens}, pack_sequences: {str(pack).lower()},
          eval_every_steps: 0, save_every_steps: 0, save_final: false, output_dir: {tmp / mode}, resume: never}}
data: {{train_files: [{tmp / 'train.jsonl'}], task: toy_copy, prompt_template: none, num_reward_workers: 1}}
logging: {{run_name: {mode}, wandb_mode: disabled, token_diagnostics: false}}
"""


def _run(tmp: Path, mode: str, args) -> dict:
    from megatron_rl.config.run import load_run_config
    from megatron_rl.loop.pipeline import make_trainer
    from megatron_rl.observability import read_metrics

    path = tmp / f"{mode}.yaml"
    path.write_text(_config(tmp, mode, args))
    cfg = load_run_config(path)
    start = time.perf_counter()
    trainer = make_trainer(cfg)
    try:
        trainer.run()
    finally:
        trainer.close()
    wall = time.perf_counter() - start
    records = [r for r in read_metrics(cfg.run_dir) if r["step"] > args.warmup]

    def median(key: str) -> float:
        return round(statistics.median(r[key] for r in records), 4)

    out = {
        "bench": "async_packing",
        "mode": mode,
        "steps_measured": len(records),
        "median_step_s": median("timing_s/step"),
        "median_update_s": median("timing_s/update"),
        "median_generate_s": median("timing_s/generate"),
        "whole_run_s": round(wall, 2),
        "padding_fraction": median("actor/padding_fraction"),
        "response_length_mean": median("rollout/response_length/mean"),
        "response_length_max": max(r["rollout/response_length/max"] for r in records),
        "microbatches_per_update": median("actor/num_microbatches"),
        "staleness_max": max(r["rollout/staleness/max"] for r in records),
    }
    for key in ("timing_s/actor_wait_rollout", "timing_s/rollout_wait_actor"):
        if key in records[0]:
            out["median_" + key.split("/")[1]] = median(key)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=2048, help="trainer.max_tokens_per_microbatch")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--idle-load", type=float, default=0.5, help="wait for a 1-minute load average below this")
    parser.add_argument("--idle-timeout-s", type=float, default=300.0)
    args = parser.parse_args()

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        _tokenizer(tmp / "tok")
        _data(tmp / "train.jsonl", 1024)
        for mode in args.modes:
            load = wait_idle(args.idle_load, args.idle_timeout_s)
            results[mode] = {**_run(tmp, mode, args), "load_before": round(load, 2)}
            print(json.dumps(results[mode]), flush=True)
    summary = {"bench": "async_packing", "summary": True, "cpu": cpu_model(),
               "cpu_cores": os.cpu_count(), "python": sys.version.split()[0], "args": vars(args)}  # fmt: skip
    for new, old in (("packed", "padded"), ("one_step_off", "sync")):
        if new in results and old in results:
            for key in ("median_step_s", "median_update_s", "whole_run_s"):
                summary[f"{new}_over_{old}_{key}"] = round(results[new][key] / results[old][key], 3)
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
