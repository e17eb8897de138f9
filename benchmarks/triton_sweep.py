"""Launch choices of the fused loss's Triton kernels (``megatron_rl.ops.triton_kernels``):
block width x warps, each pass timed alone on bf16 logits, as achieved bandwidth against
a measured device-to-device copy. Prints one JSON line per choice; CUDA only.

    PYTHONPATH=$PWD python benchmarks/triton_sweep.py --tokens 16384 --vocab 151936
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def time_cuda(fn, repeats: int, reset=None) -> tuple[float, int]:
    """Median CUDA-event seconds of ``fn`` over ``repeats`` calls after one warm-up, and the
    peak memory allocated above what was allocated before each call (``reset`` runs before
    every call, untimed)."""
    reset = reset or (lambda: None)
    reset()
    fn()
    torch.cuda.synchronize()
    times, peak = [], 0
    for _ in range(repeats):
        reset()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
        peak = max(peak, torch.cuda.max_memory_allocated() - base)
    return sorted(times)[len(times) // 2], peak


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--blocks", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("triton_sweep: needs a CUDA device", file=sys.stderr)
        return 2
    from megatron_rl.ops import triton_kernels as tk

    dev, t, v = torch.device("cuda"), args.tokens, args.vocab
    g = torch.Generator(device=dev).manual_seed(0)
    logits = torch.empty(t, v, dtype=torch.bfloat16, device=dev).normal_(generator=g).mul_(3)
    grad = torch.empty_like(logits)
    targets = torch.randint(0, v, (t,), device=dev, generator=g)
    stats = torch.empty(t, 4, device=dev)
    per_row = torch.randn(t, device=dev, generator=g) * 1e-3
    lse = torch.logsumexp(logits[:1024].float(), -1).mean().expand(t).contiguous()
    valid = torch.ones(t, dtype=torch.bool, device=dev)
    src = torch.empty(2**30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy_bw = 2 * src.numel() / time_cuda(lambda: dst.copy_(src), args.repeats)[0]
    base = {"device_name": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": t, "vocab": v}
    print(json.dumps({**base, "case": "copy", "copy_bytes_per_s": copy_bw}), flush=True)
    for block in args.blocks:
        for warps in args.warps:
            kw = dict(block=block, num_warps=warps)
            s_stats, _ = time_cuda(lambda: tk.row_stats(logits, targets, 1.0, stats, **kw), args.repeats)
            s_grad, _ = time_cuda(
                lambda: tk.row_grad(
                    logits, grad, log_normalizer=lse, row_scale=per_row, row_shift=per_row, target_cols=targets,
                    target_grad=per_row, valid=valid, inv_t=1.0, **kw,
                ),
                args.repeats,
            )  # fmt: skip
            line = {
                **base, "case": "sweep", "block": block, "num_warps": warps,
                "stats_s": s_stats, "stats_x_copy": s_stats / (2 * t * v / copy_bw),
                "grad_s": s_grad, "grad_x_copy": s_grad / (4 * t * v / copy_bw),
            }  # fmt: skip
            print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
