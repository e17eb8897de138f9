"""Chunk size of the fused lm-head mode (``fused_linear_policy_loss``) on a GPU: time and
peak memory per ``chunk_tokens`` at one size, next to the unfused path (``hidden @ W^T``
materialised, then the fused loss), with the gradients checked against that path.
Prints one JSON line per case; CUDA only.

    PYTHONPATH=$PWD python benchmarks/linear_chunk_sweep.py --tokens 16384 --chunks 441 1024 2048 4096
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=3584)
    parser.add_argument("--chunks", type=int, nargs="+", default=[441, 1024, 2048, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("linear_chunk_sweep: needs a CUDA device", file=sys.stderr)
        return 2
    sys.path.insert(0, "benchmarks")
    from fused_loss import _config
    from gpu_suite_cases import _loss_inputs
    from triton_sweep import time_cuda

    from megatron_rl.ops import VocabParallelOptions, fused_linear_policy_loss, fused_policy_loss

    dev, t, v, hs = "cuda", args.tokens, args.vocab, args.hidden
    cfg = _config()
    inputs = _loss_inputs(t, v, dev)
    g = torch.Generator(device=dev).manual_seed(11)
    weight = torch.empty(v, hs, dtype=torch.bfloat16, device=dev).normal_(generator=g).mul_(0.02).requires_grad_()
    hidden = torch.empty(t, hs, dtype=torch.bfloat16, device=dev).normal_(generator=g).requires_grad_()
    main_grad = torch.zeros(v, hs, dtype=torch.float32, device=dev)

    def reset():
        hidden.grad = weight.grad = None
        main_grad.zero_()

    def unfused():
        out, _ = fused_policy_loss(hidden @ weight.t(), inputs, cfg, VocabParallelOptions())
        out.loss_sum.backward()

    base = {"device_name": torch.cuda.get_device_name(), "tokens": t, "vocab": v, "hidden": hs}
    s, peak = time_cuda(unfused, args.repeats, reset)
    reset()
    unfused()
    ref_h, ref_w = hidden.grad.float().clone(), weight.grad.float().clone()
    print(json.dumps({**base, "case": "unfused", "fwd_bwd_s": s, "peak_extra_bytes": peak}), flush=True)
    for chunk in args.chunks:
        opts = VocabParallelOptions(chunk_tokens=chunk)

        def fused(opts=opts):
            out, _ = fused_linear_policy_loss(hidden, weight, inputs, cfg, opts, weight_main_grad=main_grad)
            out.loss_sum.backward()

        s, peak = time_cuda(fused, args.repeats, reset)
        reset()
        fused()
        dh = float((hidden.grad.float() - ref_h).abs().max()) / float(ref_h.abs().max())
        dw = float((main_grad - ref_w).abs().max()) / float(ref_w.abs().max())
        line = {**base, "case": "fused_linear", "chunk_tokens": chunk, "fwd_bwd_s": s, "peak_extra_bytes": peak,
                "grad_h_rel_err": dh, "grad_w_rel_err": dw}  # fmt: skip
        print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
