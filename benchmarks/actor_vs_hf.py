"""The actor's train step against transformers' on the vs-TRL benchmark's model, one process each.

The same work on both sides, from the same weights (transformers' init at seed 0, saved
once and loaded by both): ``vs_trl.py``'s Qwen2 (804,992 parameters, float32), a batch
of ``--rows`` x ``--tokens`` tokens of which the last ``--response`` of each row carry the
loss, one forward + backward of a token-mean policy-gradient loss whose ratio is 1 (an
on-policy step) and one AdamW step (weight decay 0.01, gradient clipping 1.0), on
``--threads`` torch threads:

- ``hf``: ``Qwen2ForCausalLM`` (SDPA attention), ``log_softmax`` over the response
  positions' logits, torch's fused AdamW (what ``actor.optimizer_kernel: auto`` picks);
- ``ours``: ``MegatronActor.train_step(on_policy=True)`` at TP = PP = DP = 1 (local spec,
  the fused lm-head loss, megatron's optimizer with the fused AdamW kernel; the plain or
  the distributed optimizer, ``--ours-optimizer``).

Each round runs both sides, alternating, each in a fresh process (``--rounds``); a run
times ``--steps`` steps after 3 warm-up steps. Prints one JSON line per run (median and
fastest step, CPU seconds per step, the first step's loss and gradient norm) and a
summary with the medians of the runs' medians, ours / hf, and how far the two first-step
gradient norms differ (they must agree to float32 rounding: the same work). This isolates the per-step cost of megatron's layers from everything else
of an RL step (generation, sync, Ray), which ``vs_trl.py`` measures whole.

    python benchmarks/actor_vs_hf.py [--rounds 3] [--steps 30] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ARCH = dict(model_type="qwen2", hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=352, vocab_size=512, max_position_embeddings=64, tie_word_embeddings=True,
            rms_norm_eps=1e-6, rope_theta=10000.0, hidden_act="silu")  # fmt: skip


def _batch(rows: int, tokens: int, response: int):
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, ARCH["vocab_size"], (rows, tokens), generator=g)
    attention = torch.ones(rows, tokens, dtype=torch.long)
    loss_mask = attention.clone()
    loss_mask[:, : tokens - response] = 0
    advantages = torch.randn(rows, 1, generator=g).expand(rows, tokens).contiguous()
    return ids, attention, loss_mask, advantages


def _save_model(directory: str) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**{k: v for k, v in ARCH.items() if k != "model_type"})).save_pretrained(directory)


def _hf_step(args):
    import torch
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(args.model, attn_implementation="sdpa", dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
    ids, attention, loss_mask, advantages = _batch(args.rows, args.tokens, args.response)
    first = args.tokens - args.response  # the first response position; its logits come from the one before

    def step():
        logits = model(input_ids=ids, attention_mask=attention).logits[:, first - 1 : -1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, first:, None]).squeeze(-1)
        ratio = torch.exp(logp - logp.detach())
        mask = loss_mask[:, first:].float()
        loss = (-(ratio * advantages[:, first:]) * mask).sum() / mask.sum()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return float(loss), float(grad_norm)

    return step


def _ours_step(args):
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    os.environ.setdefault("MASTER_PORT", str(29600 + os.getpid() % 1000))
    from megatron_rl.actor.actor import MegatronActor
    from megatron_rl.actor.batch import ActorBatch
    from megatron_rl.actor.launch import init_process_group
    from megatron_rl.actor.spec import ActorSpec
    from megatron_rl.algo import AlgorithmConfig
    from megatron_rl.config.model import ModelOptions
    from megatron_rl.config.parallel import ParallelConfig
    from megatron_rl.config.trainer import ActorConfig, TrainerConfig

    init_process_group()
    actor = MegatronActor(ActorSpec(
        architecture=args.model, parallel=ParallelConfig(num_actor_ranks=1), model=ModelOptions(dtype="float32"),
        trainer=TrainerConfig(lr=1e-3, weight_decay=0.01, grad_clip=1.0),
        actor=ActorConfig(use_distributed_optimizer=args.ours_optimizer == "distributed", optimizer_kernel="fused"),
        algorithm=AlgorithmConfig(kl_coef=0.0, eps_low=0.2, eps_high=0.24, aggregation="token_mean"),
    ))  # fmt: skip
    ids, attention, loss_mask, advantages = _batch(args.rows, args.tokens, args.response)
    actor.load_hf_weights(args.model)
    batch = ActorBatch(input_ids=ids, attention_mask=attention, loss_mask=loss_mask, advantages=advantages)

    def step():
        metrics = actor.train_step(batch, on_policy=True)
        return metrics["loss/total"], metrics["actor/grad_norm"]

    return step


def _run(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    step = _hf_step(args) if args.side == "hf" else _ours_step(args)
    first_loss, first_grad_norm = step()
    for _ in range(2):
        step()
    wall, cpu = [], []
    for _ in range(args.steps):
        t, c = time.perf_counter(), time.process_time()
        step()
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return {"median_s": statistics.median(wall), "min_s": min(wall), "cpu_s_median": statistics.median(cpu),
            "first_loss": first_loss, "first_grad_norm": first_grad_norm}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the actor's in a one-step-off run: 1)")
    parser.add_argument("--rows", type=int, default=32, help="8 prompts x 4 samples")
    parser.add_argument("--tokens", type=int, default=40, help="tokens per row: 8 prompt + 32 response")
    parser.add_argument("--response", type=int, default=32)
    parser.add_argument("--ours-optimizer", choices=("plain", "distributed"), default="plain")
    parser.add_argument("--side", choices=("hf", "ours"), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        print(json.dumps(_run(args)), flush=True)
        return
    common = ["--steps", str(args.steps), "--threads", str(args.threads), "--rows", str(args.rows),
              "--tokens", str(args.tokens), "--response", str(args.response), "--ours-optimizer", args.ours_optimizer]  # fmt: skip
    runs: dict[str, list[dict]] = {"hf": [], "ours": []}
    with tempfile.TemporaryDirectory() as model:
        _save_model(model)
        for r in range(args.rounds):
            for side in ("hf", "ours") if r % 2 == 0 else ("ours", "hf"):
                out = subprocess.run([sys.executable, __file__, "--side", side, "--model", model, *common],
                                     capture_output=True, text=True)  # fmt: skip
                if out.returncode:
                    raise RuntimeError(f"the {side} run failed: {out.stderr.strip().splitlines()[-5:]}")
                result = json.loads(out.stdout.strip().splitlines()[-1])
                runs[side].append(result)
                print(json.dumps({"bench": "actor_vs_hf", "side": side, "round": r, **result}), flush=True)
    med = {side: statistics.median(x["median_s"] for x in runs[side]) for side in runs}
    norms = {side: runs[side][0]["first_grad_norm"] for side in runs}
    print(json.dumps({
        "bench": "actor_vs_hf", "summary": True, "threads": args.threads, "rows": args.rows, "tokens": args.tokens,
        "ours_optimizer": args.ours_optimizer, "hf_step_s": med["hf"], "ours_step_s": med["ours"],
        "ours_over_hf": med["ours"] / med["hf"],
        "first_grad_norm_rel_diff": abs(norms["ours"] - norms["hf"]) / norms["hf"],
    }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
