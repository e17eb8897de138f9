"""The strong baseline's entropy: vocab-parallel entropy from logits with one softmax buffer.

Frameworks without a fused op (verl's ``entropy_from_logits`` with its custom backward)
compute the entropy next to megatron's ``vocab_parallel_cross_entropy`` with a careful
autograd function rather than plain autograd (which keeps ``exp(z - m)``, ``e * z`` and
their gradients: about 4x the logits shard). This one keeps a single buffer the size of
the logits shard:

    forward   p = softmax(z) over the vocab (max and sum all-reduced over ``group``),
              H = logZ - sum_v p z  (the sum all-reduced), saves p (the one buffer) and z
    backward  dH/dz = -p * (log p + H) * dH, computed in place in p's buffer, a chunk of
              tokens at a time (the chunk's p log p is the only temporary). It reads p
              and H only, not z: megatron's cross-entropy, run next on the same float32
              logits, overwrites them in place with its softmax
    (the forward works a chunk of tokens at a time too, so bfloat16 logits are never
    copied to float32 whole)

Shapes: ``z`` [T, V/TP] float32 or bfloat16 (the local vocab shard), result [T] float32.
Reduction group: ``group`` (the tensor-parallel group; None for one rank). The benchmarks
(``fused_loss.py``, ``gpu_suite.py``) use it as the strongest unfused baseline we know.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["entropy_one_buffer"]

# Tokens per chunk of the element-wise passes: bounds the temporaries (a bfloat16 chunk's
# float32 copy, the backward's p * z) to this many rows.
_CHUNK_TOKENS = 1024


def _chunks(tokens: int):
    return (slice(start, start + _CHUNK_TOKENS) for start in range(0, tokens, _CHUNK_TOKENS))


class _EntropyOneBuffer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z: torch.Tensor, group) -> torch.Tensor:
        m = z.max(dim=-1).values.float()
        if group is not None:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        p = torch.empty(z.shape, dtype=torch.float32, device=z.device)  # the one buffer
        sum_pz = torch.empty(z.shape[0], dtype=torch.float32, device=z.device)
        for rows in _chunks(z.shape[0]):
            torch.sub(z[rows], m[rows, None], out=p[rows])
            p[rows].exp_()
        sum_e = p.sum(-1)
        if group is not None:
            dist.all_reduce(sum_e, group=group)
        p.div_(sum_e[:, None])
        for rows in _chunks(z.shape[0]):  # a batched dot product: no [T, V] temporary
            sum_pz[rows] = torch.bmm(p[rows, None, :], z[rows, :, None].float()).view(-1)
        if group is not None:
            dist.all_reduce(sum_pz, group=group)
        log_z = torch.log(sum_e) + m
        entropy = log_z - sum_pz
        ctx.save_for_backward(p, entropy)
        ctx.z_dtype = z.dtype
        return entropy

    @staticmethod
    def backward(ctx, grad_entropy: torch.Tensor):
        p, entropy = ctx.saved_tensors
        grad = p  # reused in place: autograd never sees p again
        for rows in _chunks(p.shape[0]):
            p_log_p = torch.special.xlogy(p[rows], p[rows])  # 0 where p underflowed to 0
            grad[rows].mul_(entropy[rows, None]).add_(p_log_p).mul_(-grad_entropy[rows, None])
        return grad.to(ctx.z_dtype), None


def entropy_one_buffer(z: torch.Tensor, group=None) -> torch.Tensor:
    """Per-token entropy [T] of vocab-parallel logits ``z`` [T, V/TP] (see the module docstring)."""
    return _EntropyOneBuffer.apply(z, group)
