"""Triton kernels for the fused loss's two passes over the logits (CUDA).

The chunked torch path (:mod:`megatron_rl.ops.vocab_parallel`) runs about ten elementwise
kernels per chunk, each reading and writing a float32 copy of the chunk: on an H100 that
made the op 32x slower than reading the logits once and writing their gradient once. These
two kernels do each pass in ONE read of the logits in their own dtype (bf16 on GPUs), one
program per token row, float32 math in registers:

- :func:`row_stats`: per row ``m = max z``, ``S = sum exp(z - m)``,
  ``B = sum exp(z - m) (z - m)`` and the target's ``z`` (``z = logits / T``), the same four
  numbers the torch path all-gathers over the TP group. An online softmax: each block of
  columns rescales the running ``S`` and ``B`` to the new maximum,
  ``S' = a S``, ``B' = a (B + (m - m') S)`` with ``a = exp(m - m')``.
- :func:`row_grad`: ``dL/dlogits = p (a log p + c) + onehot(target) g`` with per-row
  constants (see ``vocab_parallel.logit_grad_chunk``), zero on masked-out rows (by selection,
  so NaN in padding rows never leaks) and on TP padding columns, written in the gradient's
  dtype; optionally each row's squared norm of the float32 gradient. The logits and the
  gradient may be the same tensor (the fused lm-head mode overwrites its chunk of logits).

Bytes moved: ``2 T V`` (stats) plus ``4 T V`` (gradient) for bf16, against the ``4 T V``
of one read and one write; a one-pass op cannot exist since a row's gradient needs its
final log-sum-exp. Exponentials are ``exp2`` of pre-scaled values (one multiply folded
into the temperature). Without a GPU the kernels run under ``TRITON_INTERPRET=1``
(Triton's interpreter, set before this module is imported): that is how CPU tests check
them against the torch path and float64 math.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def launch_config(num_cols: int, block: int | None = None, num_warps: int | None = None) -> tuple[int, int]:
    """``(BLOCK, num_warps)`` for rows of ``num_cols`` columns: blocks of up to 8,192
    columns (32 per thread at 8 warps: 16-byte loads of bf16 and enough loads in flight
    per thread to keep HBM busy with one program per row). ``block`` and ``num_warps``
    override them (``benchmarks/triton_sweep.py`` measures the choices; tests use small
    blocks to run many blocks per row)."""
    if block is None:
        block = min(8192, triton.next_power_of_2(max(num_cols, 16)))
    elif block < 16 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 16, got {block}")
    return block, num_warps or (8 if block >= 4096 else 4)


@triton.jit
def _row_stats_kernel(x_ptr, stride_x, tgt_ptr, out_ptr, num_cols, scale2, inv_t, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride_x
    offs = tl.arange(0, BLOCK)
    # Running statistics in base 2: z2 = logits * log2(e) / T, so exp2(z2 - m2) = exp(z - m).
    m2 = float("-inf")
    s = 0.0
    b2 = 0.0
    for start in range(0, num_cols, BLOCK):
        cols = start + offs
        z2 = tl.load(base + cols, mask=cols < num_cols, other=float("-inf")).to(tl.float32) * scale2
        new_m2 = tl.maximum(m2, tl.max(z2, axis=0))
        alpha = tl.exp2(m2 - new_m2)
        # (m2 - new_m2) * s is -inf * 0 before the first block: select 0 instead.
        shift = tl.where(s > 0.0, (m2 - new_m2) * s, 0.0)
        d = z2 - new_m2
        e = tl.exp2(d)  # masked columns: exp2(-inf) = 0
        b2 = alpha * (b2 + shift) + tl.sum(tl.where(cols < num_cols, e * d, 0.0), axis=0)
        s = alpha * s + tl.sum(e, axis=0)
        m2 = new_m2
    tgt = tl.load(tgt_ptr + row)
    t = tl.load(base + tgt).to(tl.float32) * inv_t
    out = out_ptr + row * 4
    tl.store(out, m2 * 0.6931471805599453)
    tl.store(out + 1, s)
    tl.store(out + 2, b2 * 0.6931471805599453)
    tl.store(out + 3, t)


@triton.jit
def _row_grad_kernel(
    x_ptr, stride_x, g_ptr, stride_g, lse_ptr, a_ptr, c_ptr, tgt_ptr, tgt_grad_ptr, valid_ptr, sq_ptr,
    num_cols, num_cols_out, inv_t,
    HAS_SHIFT: tl.constexpr, WITH_NORM: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    x_base = x_ptr + row * stride_x
    g_base = g_ptr + row * stride_g
    offs = tl.arange(0, BLOCK)
    keep = tl.load(valid_ptr + row) != 0
    lse2 = tl.load(lse_ptr + row) * 1.4426950408889634
    scale2 = inv_t * 1.4426950408889634
    a = tl.load(a_ptr + row)
    c = 0.0
    if HAS_SHIFT:
        c = tl.load(c_ptr + row)
    tgt = tl.load(tgt_ptr + row)
    tgt_grad = tl.load(tgt_grad_ptr + row)
    sq = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, num_cols_out, BLOCK):
        cols = start + offs
        real = cols < num_cols
        x = tl.load(x_base + cols, mask=real, other=0.0).to(tl.float32)
        log2p = x * scale2 - lse2
        p = tl.exp2(log2p)
        if HAS_SHIFT:
            g = p * (a * (log2p * 0.6931471805599453) + c)
        else:
            g = p * a
        g = tl.where(cols == tgt, g + tgt_grad, g)
        g = tl.where(real & keep, g, 0.0)
        if WITH_NORM:
            sq += g * g
        tl.store(g_base + cols, g.to(g_ptr.dtype.element_ty), mask=cols < num_cols_out)
    if WITH_NORM:
        tl.store(sq_ptr + row, tl.sum(sq, axis=0))


def _check_rows(x: torch.Tensor, name: str) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"{name} must be a [rows, cols] tensor with contiguous rows, got {tuple(x.shape)}")


def row_stats(
    logits: torch.Tensor,
    target_cols: torch.Tensor,
    inv_t: float,
    out: torch.Tensor,
    *,
    block: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Write ``[m, S, B, t]`` per row into ``out`` (see the module docstring).

    Args:
        logits: ``[n, V]`` any float dtype but float64, rows contiguous (a column slice of a
            wider tensor is fine).
        target_cols: ``[n]`` int64 column of each row's target, already clamped into ``[0, V)``.
        inv_t: ``1 / temperature``.
        out: ``[n, 4]`` float32, contiguous.
        block, num_warps: launch overrides (:func:`launch_config`).
    """
    _check_rows(logits, "logits")
    n, v = logits.shape
    if n == 0:
        return
    if out.dtype != torch.float32 or not out.is_contiguous() or out.shape != (n, 4):
        raise ValueError(f"out must be a contiguous float32 [{n}, 4] tensor")
    block, warps = launch_config(v, block, num_warps)
    _row_stats_kernel[(n,)](
        logits, logits.stride(0), target_cols, out, v, inv_t * LOG2E, inv_t, BLOCK=block, num_warps=warps
    )


def row_grad(
    logits: torch.Tensor,
    out: torch.Tensor,
    *,
    log_normalizer: torch.Tensor,
    row_scale: torch.Tensor,
    row_shift: torch.Tensor | None,
    target_cols: torch.Tensor,
    target_grad: torch.Tensor,
    valid: torch.Tensor,
    inv_t: float,
    sq_norm: torch.Tensor | None = None,
    block: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Write ``dL/dlogits`` of every row into ``out`` (``out`` may be ``logits`` itself).

    Args:
        logits: ``[n, V]`` the rows' real (non-padding) columns, rows contiguous.
        out: ``[n, V_out]`` with ``V_out >= V``, any float dtype; columns ``>= V`` get 0.
        log_normalizer: ``[n]`` float32 global ``log sum exp z`` of each row.
        row_scale, row_shift: ``[n]`` float32 ``a`` and ``c`` (``row_shift`` ``None``: no
            entropy term, the gradient is ``a p`` plus the target term).
        target_cols: ``[n]`` int64 local target column (clamped); ``target_grad``: ``[n]``
            float32 added there (0 where this rank does not own the target).
        valid: ``[n]`` bool; other rows are written as 0.
        sq_norm: ``[n]`` float32 to receive each row's squared gradient norm, or ``None``.
        block, num_warps: launch overrides (:func:`launch_config`).
    """
    _check_rows(logits, "logits")
    _check_rows(out, "out")
    n, v = logits.shape
    if n == 0:
        return
    if out.shape[0] != n or out.shape[1] < v:
        raise ValueError(f"out {tuple(out.shape)} does not cover logits {tuple(logits.shape)}")
    block, warps = launch_config(v, block, num_warps)
    dummy = row_scale  # an unused pointer argument still needs a tensor
    _row_grad_kernel[(n,)](
        logits, logits.stride(0), out, out.stride(0), log_normalizer, row_scale,
        dummy if row_shift is None else row_shift, target_cols, target_grad, valid.to(torch.int8),
        dummy if sq_norm is None else sq_norm, v, out.shape[1], inv_t,
        HAS_SHIFT=row_shift is not None, WITH_NORM=sq_norm is not None, BLOCK=block, num_warps=warps,
    )  # fmt: skip
