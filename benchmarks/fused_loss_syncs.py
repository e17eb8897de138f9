"""Where the fused loss makes the host wait for the device (CUDA only): runs one
forward+backward of ``fused_policy_loss`` on bf16 logits under torch's sync debug mode
and prints, as JSON lines, each synchronising call's stack (the last frames), then a
profile summary (by device and by host time) and the op's time over five calls.

    PYTHONPATH=$PWD python benchmarks/fused_loss_syncs.py --tokens 16384
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
import warnings

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--kernel", default="auto")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("fused_loss_syncs: needs a CUDA device", file=sys.stderr)
        return 2
    sys.path.insert(0, "benchmarks")
    from fused_loss import _config
    from gpu_suite_cases import _loss_inputs

    from megatron_rl.ops import VocabParallelOptions, fused_policy_loss

    cfg, dev = _config(), "cuda"
    inputs = _loss_inputs(args.tokens, args.vocab, dev)
    logits = (3 * torch.randn(args.tokens, args.vocab, device=dev)).to(torch.bfloat16).requires_grad_()
    opts = VocabParallelOptions(kernel=args.kernel)

    def step():
        logits.grad = None
        out, _ = fused_policy_loss(logits, inputs, cfg, opts)
        out.loss_sum.backward()

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    stacks = []

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f"{f.filename.split('/')[-1]}:{f.lineno} {f.name}" for f in traceback.extract_stack()[:-1]]
        stacks.append({"message": str(message)[:80], "frames": [f for f in frames if "megatron_rl" in f or ".py:" in f][-6:]})

    old = warnings.showwarning
    warnings.showwarning = record
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = old
    for s in stacks:
        print(json.dumps({"case": "sync", **s}), flush=True)
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15), flush=True)
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12), flush=True)
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    print(json.dumps({"case": "time", "tokens": args.tokens, "ms": times, "syncs": len(stacks)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
