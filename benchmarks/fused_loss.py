"""Fused vocab-parallel policy loss vs the alternatives: peak extra memory and fwd+bwd time.

Methods (same loss config, same inputs; forward + backward to the logits):
  naive      (a) gather the full logits, log_softmax + entropy + the algo loss, autograd
  megatron   (b) megatron-core vocab_parallel_cross_entropy for log-probs plus a separate
                 vocab-parallel entropy pass (plain autograd), then the algo loss
  megatron_careful (b') the same cross-entropy with a careful entropy pass: a custom
                 autograd function with one softmax buffer and an in-place backward
                 (benchmarks/entropy_baseline.py, as verl's entropy_from_logits does):
                 the strongest unfused baseline, the one ratios are quoted against
  fused      (c) megatron_rl.ops.fused_policy_loss
  fused_linear (d) megatron_rl.ops.fused_linear_policy_loss from hidden states and the
                 lm-head shard (hidden size --hidden), accumulating into a preallocated
                 main_grad as megatron DDP does

Every case runs in a fresh process (TP ranks spawned over gloo); per rank we report the
peak RSS above the RSS with inputs allocated (ru_maxrss high-water mark; the inputs are
allocated without temporaries so the mark starts at the inputs), as bytes and as a
multiple of the rank's logits shard, and the median fwd+bwd seconds over --repeats runs
after one warm-up (the baseline RSS is taken after the warm-up, with gradients freed).
Prints one JSON line per case.

``--baseline DIR`` compares this checkout with another one (e.g. ``git worktree add
/tmp/fused_old HEAD``): each case runs ``--rounds`` times per version, alternating
baseline and current, each run a fresh process of this script with ``megatron_rl``
imported from that version's checkout (PYTHONPATH; the record's ``"megatron_rl"`` says
which). Records carry ``"impl"``; a ``"summary"`` line per case gives the median of the
runs' medians and the fastest step per version, and current / baseline of each.

    python benchmarks/fused_loss.py                          # the default grid
    python benchmarks/fused_loss.py --methods fused --tokens 1024 --tp 2
    python benchmarks/fused_loss.py --methods fused --tokens 1024 --tp 1 --baseline /tmp/fused_old --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

VOCAB = 151_936  # Qwen2.5
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = ("naive", "megatron", "megatron_careful", "fused", "fused_linear")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _config():
    from megatron_rl.algo import AlgorithmConfig

    # A realistic loss: PPO-clip + k3 KL + entropy bonus, token mean.
    return AlgorithmConfig(kl_coef=0.001, entropy_coef=0.001)


def _entropy_vocab_parallel(z, group):
    """Vocab-parallel entropy with autograd (megatron's reduce mapping: all-reduce forward,
    identity backward), as frameworks without a fused op compute it."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    m = z.detach().max(dim=-1).values
    if group is not None:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    shifted = z - m[:, None]
    e = torch.exp(shifted)
    sum_e = reduce_from_tensor_model_parallel_region(e.sum(-1), group)
    sum_ez = reduce_from_tensor_model_parallel_region((e * shifted).sum(-1), group)
    return torch.log(sum_e) - sum_ez / sum_e


def _rank(rank, world, port, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    group = parallel_state.get_tensor_model_parallel_group()
    from megatron_rl.actor.launch import destroy_process_groups
    from megatron_rl.algo import compute_policy_loss
    from megatron_rl.ops import LossInputs, VocabParallelOptions, fused_linear_policy_loss, fused_policy_loss

    num_tokens, v_local = args.tokens, VOCAB // world
    cfg = _config()
    gen = torch.Generator().manual_seed(1234)  # same targets etc. on every rank
    targets = torch.randint(0, VOCAB, (num_tokens,), generator=gen)
    # all True by default; its own generator keeps the other inputs as without masking
    mask = torch.rand(num_tokens, generator=torch.Generator().manual_seed(99)) >= args.masked_fraction
    old_logp = -torch.rand(num_tokens, generator=gen) * 12
    ref_logp = old_logp + 0.1 * torch.randn(num_tokens, generator=gen)
    adv = torch.randn(num_tokens, generator=gen)
    inputs = LossInputs(targets=targets, old_logp=old_logp, advantages=adv, mask=mask, ref_logp=ref_logp)
    opts = VocabParallelOptions(tp_group=group if world > 1 else None, chunk_tokens=args.chunk_tokens)

    linear = args.method == "fused_linear"
    if linear:
        hidden = torch.empty(num_tokens, args.hidden).normal_(generator=gen).requires_grad_()
        weight = torch.empty(v_local, args.hidden).normal_(generator=gen).mul_(0.05).requires_grad_()
        main_grad = torch.zeros(v_local, args.hidden)
    else:
        logits = torch.empty(num_tokens, v_local).requires_grad_()

    def reset():
        if not linear:
            with torch.no_grad():
                logits.normal_(generator=torch.Generator().manual_seed(rank)).mul_(3.0)
            logits.grad = None
        else:
            hidden.grad = None

    def step():
        if args.method == "fused":
            out, _ = fused_policy_loss(logits, inputs, cfg, opts)
            out.loss_sum.backward()
        elif linear:
            out, _ = fused_linear_policy_loss(hidden, weight, inputs, cfg, opts, weight_main_grad=main_grad)
            out.loss_sum.backward()
        elif args.method == "megatron_careful":
            from entropy_baseline import entropy_one_buffer
            from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

            # Entropy first: on float32 logits the cross-entropy overwrites them in place with
            # its softmax (the entropy's backward reads only its own buffer).
            entropy = entropy_one_buffer(logits, group if world > 1 else None)
            logp = -vocab_parallel_cross_entropy(logits, targets)
            out = compute_policy_loss(logp, old_logp, adv, mask, cfg, ref_logp=ref_logp, entropy=entropy)
            out.loss_sum.backward()
        elif args.method == "megatron":
            from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

            entropy = _entropy_vocab_parallel(logits, group)  # before CE: CE overwrites fp32 logits in place
            logp = -vocab_parallel_cross_entropy(logits, targets)
            out = compute_policy_loss(logp, old_logp, adv, mask, cfg, ref_logp=ref_logp, entropy=entropy)
            out.loss_sum.backward()
        else:  # naive
            from torch.distributed.nn.functional import all_gather  # differentiable

            full = torch.cat(all_gather(logits, group=group), dim=-1) if world > 1 else logits
            lsm = torch.log_softmax(full, dim=-1)
            logp = lsm.gather(-1, targets[:, None]).squeeze(-1)
            entropy = -(lsm.exp() * lsm).sum(-1)
            out = compute_policy_loss(logp, old_logp, adv, mask, cfg, ref_logp=ref_logp, entropy=entropy)
            out.loss_sum.backward()

    # Warm-up first (lazy imports, thread pools, allocator arenas), then take the baseline
    # with the gradient freed: ru_maxrss - baseline is the transient peak of a steady step.
    reset()
    step()
    reset()
    base_rss = rss_bytes()
    base_peak = peak_rss_bytes()
    times = []
    for _ in range(args.repeats):
        reset()
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    peak_extra = peak_rss_bytes() - base_rss
    queue.put(
        {
            "rank": rank,
            "peak_extra_bytes": peak_extra,
            "warmup_peak_over_baseline_bytes": base_peak - base_rss,
            "times_s": times,
        }
    )
    destroy_process_groups()


def run_case(args) -> dict:
    """One case, all TP ranks, in this (fresh) process; returns the JSON record."""
    import megatron_rl

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(args.tp, port, args, queue), nprocs=args.tp, join=True)
    ranks = sorted((queue.get() for _ in range(args.tp)), key=lambda r: r["rank"])
    shard = args.tokens * (VOCAB // args.tp) * 4
    worst = max(r["peak_extra_bytes"] for r in ranks)
    med = statistics.median(statistics.median(r["times_s"]) for r in ranks)
    return {
        "bench": "fused_loss",
        "method": args.method,
        "tokens": args.tokens,
        "vocab": VOCAB,
        "tp": args.tp,
        "hidden": args.hidden if args.method == "fused_linear" else None,
        "dtype": "float32",
        "logits_shard_bytes": shard,
        "peak_extra_bytes_per_rank": [r["peak_extra_bytes"] for r in ranks],
        "peak_extra_x_shard": round(worst / shard, 3),
        "fwd_bwd_s_median": round(med, 4),
        "fwd_bwd_s_min": round(statistics.median(min(r["times_s"]) for r in ranks), 4),
        "repeats": args.repeats,
        "threads_per_rank": max(1, (os.cpu_count() or 1) // args.tp),
        "device": "cpu",
        "masked_fraction": args.masked_fraction,
        "chunk_tokens": args.chunk_tokens,
        "megatron_rl": os.path.dirname(os.path.abspath(megatron_rl.__file__)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--tokens", nargs="+", type=int, default=[1024, 4096, 8192])
    parser.add_argument("--tp", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--hidden", type=int, default=256, help="hidden size for fused_linear")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk-tokens", type=int, default=None)
    parser.add_argument(
        "--masked-fraction", type=float, default=0.0,
        help="fraction of tokens masked out (at random; their logit-gradient rows are zeroed)",
    )  # fmt: skip
    parser.add_argument("--baseline", default=None, help="another checkout to compare with, run interleaved")
    parser.add_argument("--rounds", type=int, default=1, help="runs per case and version (with --baseline)")
    parser.add_argument(
        "--max-case-bytes", type=float, default=18e9,
        help="skip a case whose estimated memory (all ranks) exceeds this; it is reported as skipped",
    )  # fmt: skip
    parser.add_argument("--case", action="store_true", help=argparse.SUPPRESS)  # internal: run one case
    parser.add_argument("--method", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.case:
        args.tokens, args.tp = args.tokens[0], args.tp[0]
        print(json.dumps(run_case(args)), flush=True)
        return

    # Rough total bytes of a case (inputs + extra), to skip what cannot fit this machine.
    extra_x = {"naive": 6.0, "megatron": 3.0, "megatron_careful": 2.2, "fused": 2.2, "fused_linear": 0.2}
    for tp in args.tp:
        for tokens in args.tokens:
            for method in args.methods:
                shard = tokens * (VOCAB // tp) * 4
                factor = extra_x[method] + (tp - 1) * (5.0 if method == "naive" else 0.0)
                estimate = tp * shard * factor
                if estimate > args.max_case_bytes:
                    print(json.dumps({
                        "bench": "fused_loss", "method": method, "tokens": tokens, "tp": tp,
                        "skipped": f"estimated {estimate / 1e9:.1f} GB > --max-case-bytes {args.max_case_bytes / 1e9:.0f} GB",
                    }), flush=True)  # fmt: skip
                    continue
                cmd = [
                    sys.executable, __file__, "--case", "--method", method, "--tokens", str(tokens),
                    "--tp", str(tp), "--hidden", str(args.hidden), "--repeats", str(args.repeats),
                    "--masked-fraction", str(args.masked_fraction),
                ]  # fmt: skip
                if args.chunk_tokens:
                    cmd += ["--chunk-tokens", str(args.chunk_tokens)]
                if args.baseline is None:
                    _run(cmd, None)
                    continue
                medians: dict[str, list[float]] = {"baseline": [], "current": []}
                mins: dict[str, list[float]] = {"baseline": [], "current": []}
                for _ in range(args.rounds):
                    for impl, root in (("baseline", args.baseline), ("current", REPO_ROOT)):
                        record = _run(cmd, root, impl)
                        if "fwd_bwd_s_median" in record:
                            medians[impl].append(record["fwd_bwd_s_median"])
                            mins[impl].append(record["fwd_bwd_s_min"])
                if all(medians.values()):
                    base, cur = (statistics.median(medians[k]) for k in ("baseline", "current"))
                    base_min, cur_min = (min(mins[k]) for k in ("baseline", "current"))
                    # On a shared machine the fastest step is the least disturbed one.
                    print(json.dumps({
                        "bench": "fused_loss", "summary": True, "method": method, "tokens": tokens, "tp": tp,
                        "masked_fraction": args.masked_fraction, "baseline": args.baseline,
                        "baseline_s": medians["baseline"], "current_s": medians["current"],
                        "baseline_median_s": base, "current_median_s": cur, "current_over_baseline": round(cur / base, 3),
                        "baseline_min_s": base_min, "current_min_s": cur_min,
                        "current_over_baseline_min": round(cur_min / base_min, 3),
                    }), flush=True)  # fmt: skip


def _run(cmd: list[str], root: str | None, impl: str | None = None) -> dict:
    """Run one case in a fresh process (with ``megatron_rl`` imported from the checkout
    ``root`` when given: the same script, another implementation); print and return its
    record."""
    env = dict(os.environ)
    if root is not None:
        env["PYTHONPATH"] = os.path.abspath(root) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        record = {
            "bench": "fused_loss", "method": cmd[cmd.index("--method") + 1], "tokens": int(cmd[cmd.index("--tokens") + 1]),
            "tp": int(cmd[cmd.index("--tp") + 1]), "error": (proc.stderr.strip().splitlines() or ["?"])[-1],
        }  # fmt: skip
    else:
        record = json.loads(lines[-1])
    if impl is not None:
        record["impl"] = impl
    print(json.dumps(record), flush=True)
    return record


if __name__ == "__main__":
    main()
