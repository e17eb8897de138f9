"""Chunked statistics of a vocab-parallel softmax, with ONE collective per call.

Each tensor-parallel rank holds the logits of a contiguous vocabulary shard
``[start, start + V_local)``. For every token this module computes, chunk by chunk over
tokens and in float32 whatever the logits' dtype:

    m_r  = max_j z_j                         (over this rank's columns)
    S_r  = sum_j exp(z_j - m_r)
    B_r  = sum_j exp(z_j - m_r) (z_j - m_r)
    t_r  = z_target if this rank owns the target id, else 0

with ``z = logits / temperature``. These four numbers per token are all-gathered over the
TP group once (``[T, 4]`` per rank, independent of the vocabulary size) and merged:

    M = max_r m_r,   S = sum_r S_r e^{m_r - M}
    logp_target = t - M - log S
    H = log S - (1 / S) sum_r e^{m_r - M} (B_r + (m_r - M) S_r)

so the vocabulary is never gathered and no ``[T, V]`` buffer outlives one chunk. The
math runs in float32 for bf16/fp16/fp32 logits and in float64 for float64 logits (so
``gradcheck`` applies). The per-token ``M`` and ``log S`` are kept (``[T]`` each) so a later pass can rebuild the
softmax of any chunk exactly: ``p_j = exp(z_j - M - log S)``.

Vocabulary padding (``vocab_size`` smaller than ``V_local * tp``, as Megatron pads for
TP divisibility) is excluded: padded columns take no part in the softmax.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEFAULT_CHUNK_BYTES = 4 * 2**20
"""Default float32 footprint of one chunk of logits; see :func:`chunk_rows`. Small enough
that a chunk and its two work buffers stay in the last-level cache, so the several
elementwise passes per chunk cost one read of the logits from memory, not several."""


LINEAR_CHUNK_BYTES = {"cuda": 256 * 2**20, "cpu": 64 * 2**20}
"""Default float32 footprint of one chunk of logits in the fused lm-head mode, per device
type. Each chunk's logits come from a ``[n, H] x [H, V_local]`` matmul and its weight
gradient is added into the whole ``[V_local, H]`` gradient: chunks of a few tokens leave
the matmuls inefficient and re-read that gradient hundreds of times (measured on CPU at
the Qwen2.5 vocabulary and hidden 512: 6x slower than materialising the logits), so this
mode takes large chunks. On a GPU the re-read weight gradient is what bounds them (256 MiB
keeps it well under the matmuls' time); on a CPU the matmuls are slow anyway and 64 MiB
keeps the chunk buffers small (tested: 110-token chunks cost about as much time as
materialising the logits)."""


def linear_chunk_rows(num_tokens: int, vocab_local: int, device: torch.device | str = "cpu") -> int:
    """Tokens per chunk of the fused lm-head mode: as many as fit :data:`LINEAR_CHUNK_BYTES`."""
    budget = LINEAR_CHUNK_BYTES["cuda" if torch.device(device).type == "cuda" else "cpu"]
    return max(1, min(max(num_tokens, 1), budget // (4 * max(vocab_local, 1))))


def tp_rank_and_size(tp_group: dist.ProcessGroup | None) -> tuple[int, int]:
    """This rank's index and the size of ``tp_group`` (``None``: no tensor parallelism)."""
    if tp_group is None or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(tp_group), dist.get_world_size(tp_group)


def chunk_rows(num_tokens: int, vocab_local: int, chunk_tokens: int | None) -> int:
    """Tokens per chunk: ``chunk_tokens``, or as many as fit :data:`DEFAULT_CHUNK_BYTES` in float32."""
    if chunk_tokens is not None:
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        return chunk_tokens
    return max(1, min(max(num_tokens, 1), DEFAULT_CHUNK_BYTES // (4 * max(vocab_local, 1))))


@dataclass
class VocabShard:
    """Where this rank's columns sit in the global vocabulary.

    ``start``: global id of local column 0; ``num_valid``: local columns that are real
    vocabulary entries (the rest are TP padding); ``vocab_size``: the global true size.
    """

    start: int
    num_valid: int
    vocab_size: int

    @staticmethod
    def of(vocab_local: int, tp_group: dist.ProcessGroup | None, vocab_size: int | None) -> "VocabShard":
        rank, size = tp_rank_and_size(tp_group)
        padded = vocab_local * size
        vocab_size = padded if vocab_size is None else vocab_size
        if not 0 < vocab_size <= padded:
            raise ValueError(
                f"vocab_size={vocab_size} does not fit the logits: {size} TP rank(s) x {vocab_local} columns"
            )
        start = rank * vocab_local
        return VocabShard(start=start, num_valid=max(0, min(vocab_local, vocab_size - start)), vocab_size=vocab_size)


@dataclass
class SoftmaxStats:
    """Per-token results of :func:`softmax_stats`, all ``[T]`` in the compute dtype.

    ``logp``: log-prob of the target; ``entropy``: full-distribution entropy;
    ``log_normalizer``: ``log sum_j exp(z_j)`` over the whole (global) vocabulary, which
    rebuilds the softmax of any chunk as ``p_j = exp(z_j - log_normalizer)``.
    Masked-out tokens hold 0 in ``logp`` and ``entropy``. ``logit_grad_norm`` is filled by
    the training ops when asked (``VocabParallelOptions.token_grad_norms``): the norm of
    each token's loss-sum gradient w.r.t. its logits row, over the whole vocabulary.
    """

    logp: torch.Tensor
    entropy: torch.Tensor
    log_normalizer: torch.Tensor
    logit_grad_norm: torch.Tensor | None = None


class ChunkWorkspace:
    """Two reusable ``[rows, V_local]`` buffers in the compute dtype.

    Reusing them keeps every chunk's temporaries in the same cache-sized memory, instead
    of allocating (and page-faulting) fresh ones per chunk.
    """

    def __init__(self, rows: int, width: int, dtype: torch.dtype, device: torch.device):
        self.a = torch.empty(rows, width, dtype=dtype, device=device)
        self.b = torch.empty(rows, width, dtype=dtype, device=device)

    def scaled_logits(self, raw: torch.Tensor, inv_t: float) -> torch.Tensor:
        """``raw * inv_t`` in the compute dtype, in buffer ``a`` (or ``raw`` itself when no
        conversion is needed). The conversion happens BEFORE scaling, so bf16 logits are
        scaled in float32."""
        n = raw.shape[0]
        if raw.dtype == self.a.dtype and inv_t == 1.0:
            return raw
        z = self.a[:n]
        if raw.dtype == self.a.dtype:
            return torch.mul(raw, inv_t, out=z)
        z.copy_(raw)
        return z.mul_(inv_t) if inv_t != 1.0 else z


def check_targets(targets: torch.Tensor, valid: torch.Tensor, vocab_size: int) -> None:
    """Raise ``ValueError`` naming the first valid position whose target id is out of range."""
    bad = valid & ((targets < 0) | (targets >= vocab_size))
    if bool(bad.any()):
        pos = int(torch.nonzero(bad)[0, 0])
        raise ValueError(
            f"target id {int(targets[pos])} at token {pos} is outside the vocabulary [0, {vocab_size}) "
            "but the token is not masked out"
        )


def softmax_stats(
    chunk_logits: Callable[[slice], torch.Tensor],
    targets: torch.Tensor,
    valid: torch.Tensor,
    *,
    vocab_local: int,
    temperature: float,
    tp_group: dist.ProcessGroup | None,
    vocab_size: int | None,
    chunk_tokens: int | None,
    compute_dtype: torch.dtype = torch.float32,
    workspace: ChunkWorkspace | None = None,
) -> SoftmaxStats:
    """Target log-probs, entropies and softmax normalisers of vocab-parallel logits.

    Args:
        chunk_logits: returns the ``[rows, V_local]`` logits of a slice of tokens (a view of
            a logits tensor, or ``hidden[rows] @ weight.T`` in fused-linear mode).
        targets: ``[T]`` int64 global target ids (anything at masked-out tokens, -100 too).
        valid: ``[T]`` bool, tokens whose results matter.
        vocab_local: columns per rank (the shard width).
        temperature: logits are divided by it before the softmax.
        tp_group: the tensor-parallel group (one all-gather of ``[T, 4]`` on it);
            ``None`` for no tensor parallelism.
        vocab_size: true global vocabulary size (columns beyond it are padding).
        chunk_tokens: tokens per chunk (``None``: by :data:`DEFAULT_CHUNK_BYTES`).
        compute_dtype: float32 (default), or float64 for float64 logits.
        workspace: buffers to reuse (e.g. across the stats and gradient passes).

    Returns:
        :class:`SoftmaxStats`, identical on every rank of ``tp_group``.
    """
    shard = VocabShard.of(vocab_local, tp_group, vocab_size)
    check_targets(targets, valid, shard.vocab_size)
    num_tokens = targets.shape[0]
    device = targets.device
    local = torch.zeros(num_tokens, 4, dtype=compute_dtype, device=device)  # m, S, B, t
    local_target = targets - shard.start
    owned = valid & (local_target >= 0) & (local_target < shard.num_valid)
    rows = chunk_rows(num_tokens, vocab_local, chunk_tokens)
    inv_t = 1.0 / temperature
    if shard.num_valid == 0:  # a rank holding padding only takes no part in the softmax
        local[:, 0] = float("-inf")
    else:
        ws = workspace or ChunkWorkspace(rows, shard.num_valid, compute_dtype, device)
        tgt_all = local_target.clamp(0, shard.num_valid - 1)[:, None]
        for begin in range(0, num_tokens, rows):
            sl = slice(begin, min(begin + rows, num_tokens))
            z = ws.scaled_logits(chunk_logits(sl)[:, : shard.num_valid], inv_t)
            m = z.amax(dim=-1)
            local[sl, 0] = m
            local[sl, 3] = z.gather(-1, tgt_all[sl]).squeeze(-1)
            shifted = torch.sub(z, m[:, None], out=ws.b[: z.shape[0]])
            e = torch.exp(shifted, out=ws.a[: z.shape[0]])  # z is dead now; reuse its buffer
            local[sl, 1] = e.sum(dim=-1)
            local[sl, 2] = torch.linalg.vecdot(e, shifted)
        local[:, 3] = torch.where(owned, local[:, 3], 0.0)

    _, size = tp_rank_and_size(tp_group)
    if size == 1:
        stats = local[None]
    else:
        gathered = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(gathered, local, group=tp_group)
        stats = torch.stack(gathered)  # [TP, T, 4]
    m_r, s_r, b_r, t_r = stats.unbind(-1)
    big_m = m_r.max(dim=0).values
    scale = torch.exp(m_r - big_m)  # 0 for padding-only ranks (m_r = -inf)
    s = (s_r * scale).sum(dim=0)
    # (m_r - M) * S_r is -inf * 0 on padding-only ranks: zero it explicitly.
    shift_term = torch.where(s_r > 0, (m_r - big_m) * s_r, torch.zeros_like(s_r))
    sum_pz = ((b_r + shift_term) * scale).sum(dim=0)
    log_s = torch.log(s)
    logp = t_r.sum(dim=0) - big_m - log_s
    entropy = log_s - sum_pz / s
    zero = torch.zeros_like(logp)
    return SoftmaxStats(
        logp=torch.where(valid, logp, zero),
        entropy=torch.where(valid, entropy, zero),
        log_normalizer=big_m + log_s,
    )


def logit_grad_chunk(
    raw_logits: torch.Tensor,
    rows: slice,
    stats: SoftmaxStats,
    tgt_local: torch.Tensor,
    owned_grad: torch.Tensor,
    row_scale: torch.Tensor,
    row_shift: torch.Tensor | None,
    *,
    inv_t: float,
    workspace: ChunkWorkspace,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """d loss / d logits for one chunk of this rank's real (non-padding) columns.

    With ``z = logits / T``, ``p = exp(z - log_normalizer)``:
    ``dL/dlogits_j = [g_logp onehot_j - p_j (g_logp + g_H (log p_j + H))] / T``, written
    here as ``p_j * (a * log p_j + c) + onehot_j * g_logp / T`` with per-row constants
    ``a = -g_H / T`` (``row_scale``) and ``c = -(g_logp + g_H H) / T`` (``row_shift``);
    without an entropy term ``row_shift`` is ``None`` and the gradient is ``c * p``.

    Args:
        raw_logits: ``[n, V_valid]`` logits of the chunk (any float dtype).
        tgt_local: ``[T, 1]`` local target column (clamped into range).
        owned_grad: ``[T]`` ``g_logp / T`` where this rank owns the target, else 0.
        out: where to write (``[n, V_valid]``, compute dtype); default a workspace buffer.

    Returns:
        The gradient, ``[n, V_valid]`` in the compute dtype (``out`` if given). Rows of
        masked-out tokens are NOT zeroed here (the caller does, by assignment).
    """
    n = raw_logits.shape[0]
    log_p = workspace.scaled_logits(raw_logits, inv_t)
    if log_p is raw_logits:  # never write into the caller's logits
        log_p = torch.sub(raw_logits, stats.log_normalizer[rows, None], out=workspace.a[:n])
    else:
        log_p.sub_(stats.log_normalizer[rows, None])
    p = torch.exp(log_p, out=workspace.b[:n])
    target = out if out is not None else workspace.a[:n]
    if row_shift is None:
        torch.mul(p, row_scale[rows, None], out=target)
    else:
        log_p.mul_(row_scale[rows, None]).add_(row_shift[rows, None])
        torch.mul(p, log_p, out=target)
    target.scatter_add_(-1, tgt_local[rows], owned_grad[rows, None])
    return target
