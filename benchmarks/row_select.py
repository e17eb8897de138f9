"""Does multiplying only the loss's tokens through the lm-head pay on a GPU?

``fused_linear_policy_loss`` selects the rows of ``inputs.mask`` before the lm-head
matmuls in a training call (``megatron_rl/ops/token_rows.py``); on CUDA finding the rows
(``nonzero``) is a host synchronisation. This measures the op with and without the
selection on one device, side by side, at several fractions of loss tokens (RL
micro-batches carry prompt and padding tokens with no loss):

``all``       ``loss_rows_only=False``: every row through the lm-head, no host read.
``selected``  the default: ``mask.nonzero()`` (a host sync), ``index_select`` of the hidden
              rows and the per-token inputs, the lm-head on those rows; the hidden
              gradient scatters back through ``index_select``'s backward.

Each is timed twice: alone (synchronised before and after) and ``queued`` behind
``--queue-ms`` of GEMM work launched just before it, as in an actor step where the
loss follows the model's forward on the stream: there the sync makes the host wait for
the queued work before it can launch the loss, while ``all`` launches ahead.
Results agree (loss sum, hidden and weight gradients) and are checked each run.

    PYTHONPATH=$PWD python benchmarks/row_select.py                   # on the GPU machine
    python benchmarks/row_select.py --device cpu --tokens 512 --vocab 4096 --hidden 256

Prints one JSON line per (fraction, method, mode) and an ``agreement`` line per fraction.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
for _p in (str(HERE.parent), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402

from megatron_rl.algo import AlgorithmConfig  # noqa: E402
from megatron_rl.ops import LossInputs, VocabParallelOptions, fused_linear_policy_loss  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _inputs(num_tokens: int, vocab: int, fraction: float, device: torch.device) -> LossInputs:
    g = torch.Generator().manual_seed(1234)
    old_logp = -torch.rand(num_tokens, generator=g) * 12
    mask = torch.zeros(num_tokens, dtype=torch.bool)
    # Sequences of 1,024 tokens whose first (1 - fraction) are prompt: contiguous runs, as in a batch.
    seq = min(1024, num_tokens)
    for start in range(0, num_tokens, seq):
        mask[start + int(round(seq * (1 - fraction))) : start + seq] = True
    return LossInputs(
        targets=torch.randint(0, vocab, (num_tokens,), generator=g).to(device),
        old_logp=old_logp.to(device),
        advantages=torch.randn(num_tokens, generator=g).to(device),
        mask=mask.to(device),
        ref_logp=(old_logp + 0.1 * torch.randn(num_tokens, generator=g)).to(device),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=3584)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.5, 0.75, 0.9375])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--queue-ms", type=float, default=30.0, help="GEMM work queued before the 'queued' mode")
    args = p.parse_args()

    device = torch.device(args.device)
    dt = getattr(torch, args.dtype)
    cfg = AlgorithmConfig(kl_coef=0.001, entropy_coef=0.001)
    opts = VocabParallelOptions()
    g = torch.Generator(device=device).manual_seed(11)
    weight = (
        torch.empty(args.vocab, args.hidden, dtype=dt, device=device).normal_(generator=g) * 0.02
    ).requires_grad_()
    main_grad = torch.zeros(args.vocab, args.hidden, dtype=torch.float32, device=device)
    hidden = torch.empty(args.tokens, args.hidden, dtype=dt, device=device).normal_(generator=g).requires_grad_()

    # The queue: square GEMMs sized so that their count gives about --queue-ms.
    n = 4096 if device.type == "cuda" else 256
    a = torch.randn(n, n, dtype=dt, device=device)
    for _ in range(3):  # warm-up (library handles, kernel choice) outside the calibration
        a @ a
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(20):
        a @ a
    _sync(device)
    per_gemm_s = (time.perf_counter() - t0) / 20
    queue_len = max(1, int(args.queue_ms / 1e3 / per_gemm_s))

    def run(inputs: LossInputs, selected: bool) -> torch.Tensor:
        out, _ = fused_linear_policy_loss(hidden, weight, inputs, cfg, opts, weight_main_grad=main_grad,
                                          loss_rows_only=selected)  # fmt: skip
        out.loss_sum.backward()
        return out.loss_sum.detach()

    def reset() -> None:
        hidden.grad = None
        weight.grad = None
        main_grad.zero_()

    meta = dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", torch=torch.__version__,
                tokens=args.tokens, vocab=args.vocab, hidden=args.hidden, dtype=args.dtype)  # fmt: skip
    for fraction in args.fractions:
        inputs = _inputs(args.tokens, args.vocab, fraction, device)
        results = {}
        for selected in (False, True):
            reset()
            loss = run(inputs, selected)
            results[selected] = (loss, hidden.grad.clone(), main_grad.clone())
        (l0, h0, w0), (l1, h1, w1) = results[False], results[True]
        print(json.dumps({**meta, "fraction": fraction, "method": "agreement",
                          "loss_rel_diff": float((l0 - l1).abs() / l0.abs().clamp_min(1e-30)),
                          "hidden_grad_max_diff": float((h0 - h1).abs().max()),
                          "weight_grad_max_diff": float((w0 - w1).abs().max()),
                          "weight_grad_max": float(w0.abs().max())}), flush=True)  # fmt: skip
        del results, h0, h1, w0, w1
        for mode in ("alone", "queued"):
            for selected in (False, True):
                times = []
                for i in range(args.repeats + 2):
                    reset()
                    _sync(device)
                    t0 = time.perf_counter()
                    if mode == "queued":
                        for _ in range(queue_len):
                            a @ a
                    run(inputs, selected)
                    _sync(device)
                    if i >= 2:
                        times.append(time.perf_counter() - t0)
                queue_s = queue_len * per_gemm_s if mode == "queued" else 0.0
                print(json.dumps({**meta, "fraction": fraction, "loss_tokens": int(inputs.mask.sum()),
                                  "method": "selected" if selected else "all", "mode": mode,
                                  "queued_gemm_s_est": queue_s, "median_s": statistics.median(times),
                                  "times_s": times}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
