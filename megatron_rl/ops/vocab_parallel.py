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

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

CHUNK_BYTES = {"cuda": 256 * 2**20, "cpu": 4 * 2**20}
"""Default float32 footprint of one chunk of materialised logits, per device type (one
budget per chunk; the op holds two such work buffers). See :func:`chunk_budget_bytes`.

- CPU, 4 MiB: small enough that a chunk and its two work buffers stay in the last-level
  cache, so the several elementwise passes per chunk cost one read of the logits from
  memory, not several (27 tokens at V/TP = 38k).
- CUDA, 256 MiB (the torch kernel; the Triton kernels need no workspace): a GPU has no such cache to fit (50 MiB of L2 on an H100) but pays a
  kernel launch (~5 us of host time) per elementwise pass and per chunk. At 4 MiB a pass
  takes ~2.5 us of device time at the H100's ~3.35 TB/s, so the op would be launch-bound
  (and idle between chunks); at 256 MiB a read+write pass takes ~160 us, so the ~10
  launches of a chunk are hidden behind the previous chunk's kernels and larger chunks
  gain at most a few per cent. 256 MiB is 441 tokens at V/TP = 151,936 and 1,766 at
  37,984: enough rows to fill every SM in the row reductions. The workspace stays bounded
  whatever the token count: 2 x 256 MiB, under 1 % of an 80 GB GPU.
"""

DEFAULT_CHUNK_BYTES = CHUNK_BYTES["cpu"]
"""The CPU budget of :data:`CHUNK_BYTES` (kept for callers that predate per-device
budgets); :func:`chunk_budget_bytes` gives the budget of any device."""


LINEAR_CHUNK_BYTES = {"cuda": 2**30, "cpu": 64 * 2**20}
"""Default float32 footprint of one chunk of logits in the fused lm-head mode, per device
type. Each chunk's logits come from a ``[n, H] x [H, V_local]`` matmul and its weight
gradient is added into the whole ``[V_local, H]`` gradient: chunks of a few tokens leave
the matmuls inefficient and re-read that gradient hundreds of times (on CPU, several times
slower than materialising the logits), so this mode takes large chunks. On a GPU, 1 GiB
(1,766 tokens at V/TP = 151,936; with the Triton kernels the chunk's logits are bf16,
0.5 GiB, overwritten by their gradient): past ~2k tokens per chunk the time gains little
while the memory grows linearly (``benchmarks/linear_chunk_sweep.py``; docs/benchmarks.md).
On a CPU the matmuls are slow anyway and 64 MiB keeps the chunk buffers small."""


def _device_kind(device: torch.device | str) -> str:
    """``"cuda"`` for CUDA devices, ``"cpu"`` for everything else."""
    return "cuda" if torch.device(device).type == "cuda" else "cpu"


def chunk_budget_bytes(device: torch.device | str = "cpu", *, linear: bool = False) -> int:
    """Float32 bytes of one chunk of logits on ``device`` (``"cuda"``/``"cpu"`` or a torch
    device): :data:`LINEAR_CHUNK_BYTES` in the fused lm-head mode (``linear``), else
    :data:`CHUNK_BYTES`. The op and the memory planner both size chunks with it."""
    return (LINEAR_CHUNK_BYTES if linear else CHUNK_BYTES)[_device_kind(device)]


def _rows_for(budget: int, num_tokens: int, vocab_local: int) -> int:
    return max(1, min(max(num_tokens, 1), budget // (4 * max(vocab_local, 1))))


def linear_chunk_rows(num_tokens: int, vocab_local: int, device: torch.device | str = "cpu") -> int:
    """Tokens per chunk of the fused lm-head mode: as many as fit :data:`LINEAR_CHUNK_BYTES`."""
    return _rows_for(chunk_budget_bytes(device, linear=True), num_tokens, vocab_local)


KERNELS = ("auto", "torch", "triton")
"""Implementations of the two passes over the logits: ``torch`` (chunked torch ops, any
device and dtype), ``triton`` (:mod:`megatron_rl.ops.triton_kernels`: one read per pass, CUDA,
not float64) and ``auto`` (``triton`` for CUDA tensors when Triton imports and the dtype is
not float64, else ``torch``)."""


def resolve_kernel(kernel: str, x: torch.Tensor) -> str:
    """``"torch"`` or ``"triton"`` for ``kernel`` (one of :data:`KERNELS`) on tensor ``x``.

    An explicit ``triton`` that cannot run raises ``ValueError`` saying why: float64
    logits, or a tensor that is not on a CUDA device outside Triton's interpreter
    (``TRITON_INTERPRET=1``, how CPU tests run the kernels), or no Triton installed.
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if kernel == "torch":
        return "torch"
    has_triton = importlib.util.find_spec("triton") is not None
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if kernel == "auto":
        return "triton" if x.is_cuda and has_triton and x.dtype != torch.float64 else "torch"
    if x.dtype == torch.float64:
        raise ValueError("kernel='triton' computes in float32; float64 logits need kernel='torch' or 'auto'")
    if not has_triton:
        raise ValueError("kernel='triton' but Triton is not installed")
    if not (x.is_cuda or interpreted):
        raise ValueError(f"kernel='triton' needs CUDA tensors (or TRITON_INTERPRET=1), got {x.device}")
    return "triton"


def tp_rank_and_size(tp_group: dist.ProcessGroup | None) -> tuple[int, int]:
    """This rank's index and the size of ``tp_group`` (``None``: no tensor parallelism)."""
    if tp_group is None or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(tp_group), dist.get_world_size(tp_group)


def row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``[n]`` row-wise dot products of two ``[n, V]`` tensors, as a batched matmul: no
    ``[n, V]`` product is made (``torch.linalg.vecdot`` multiplies first, a temporary the
    size of a chunk of logits on top of the workspace)."""
    return torch.matmul(a.unsqueeze(-2), b.unsqueeze(-1)).view(a.shape[0])


def chunk_rows(
    num_tokens: int, vocab_local: int, chunk_tokens: int | None, device: torch.device | str = "cpu",
    *, kernel: str = "torch",
) -> int:  # fmt: skip
    """Tokens per chunk: ``chunk_tokens``, or else for the torch kernel as many as fit the
    device's :data:`CHUNK_BYTES` budget in float32, for the Triton kernels all tokens (they
    keep no float32 workspace, so one launch covers the whole input)."""
    if chunk_tokens is not None:
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        return chunk_tokens
    if kernel == "triton":
        return max(num_tokens, 1)
    return _rows_for(chunk_budget_bytes(device), num_tokens, vocab_local)


def chunk_slices(num_tokens: int, rows: int) -> list[slice]:
    """The token slices of consecutive chunks of ``rows`` tokens (the last may be shorter)."""
    return [slice(b, min(b + rows, num_tokens)) for b in range(0, num_tokens, rows)]


def invalid_rows_per_chunk(valid: torch.Tensor, rows: int) -> list[torch.Tensor | None]:
    """For each chunk of ``rows`` tokens, the chunk-local row indices of its masked-out
    tokens (``None`` where it has none), to zero those gradient rows with ``index_fill_``.

    One device-to-host read per call (the per-chunk counts); the indices themselves stay on
    the device (``nonzero_static`` of the now known size does not synchronise), so the
    chunk loops branch on host ints instead of synchronising once per chunk.
    """
    num_tokens = valid.shape[0]
    num_chunks = -(-num_tokens // rows)
    invalid = torch.zeros(num_chunks * rows, dtype=torch.bool, device=valid.device)
    torch.logical_not(valid, out=invalid[:num_tokens])
    counts = invalid.view(num_chunks, rows).sum(dim=1).tolist()
    total = sum(counts)
    if total == 0:
        return [None] * num_chunks
    local = torch.nonzero_static(invalid, size=total).squeeze(1) % rows  # ascending: chunk by chunk
    out: list[torch.Tensor | None] = []
    begin = 0
    for count in counts:
        out.append(local[begin : begin + count] if count else None)
        begin += count
    return out


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
        self.rows = rows
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
    """Raise ``ValueError`` naming the first valid position whose target id is out of range.

    Once per call, before any chunk loop: its one device-to-host read is the op's only
    synchronisation besides :func:`invalid_rows_per_chunk` (none happens per chunk).
    """
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
    kernel: str = "torch",
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
        chunk_tokens: tokens per chunk (``None``: by the device's :data:`CHUNK_BYTES`;
            ignored when ``workspace`` is given, whose row count is the chunk size).
        compute_dtype: float32 (default), or float64 for float64 logits.
        workspace: buffers to reuse (e.g. across the stats and gradient passes; the torch
            kernel only).
        kernel: ``"torch"`` or ``"triton"`` (resolved, :func:`resolve_kernel`); Triton
            takes ``chunk_tokens`` rows per launch, all tokens at once when ``None``.

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
    inv_t = 1.0 / temperature
    if shard.num_valid == 0:  # a rank holding padding only takes no part in the softmax
        local[:, 0] = float("-inf")
    else:
        tgt = local_target.clamp(0, shard.num_valid - 1)
        if kernel == "triton":
            from megatron_rl.ops import triton_kernels

            for sl in chunk_slices(num_tokens, chunk_rows(num_tokens, vocab_local, chunk_tokens, kernel=kernel)):
                triton_kernels.row_stats(chunk_logits(sl)[:, : shard.num_valid], tgt[sl], inv_t, local[sl])
        else:
            # A given workspace fixes the chunk size (its buffers are that many rows).
            rows = (
                workspace.rows if workspace is not None else chunk_rows(num_tokens, vocab_local, chunk_tokens, device)
            )
            ws = workspace or ChunkWorkspace(rows, shard.num_valid, compute_dtype, device)
            # No host synchronisation in this loop: everything stays on the device.
            for sl in chunk_slices(num_tokens, rows):
                z = ws.scaled_logits(chunk_logits(sl)[:, : shard.num_valid], inv_t)
                m = z.amax(dim=-1)
                local[sl, 0] = m
                local[sl, 3] = z.gather(-1, tgt[sl, None]).squeeze(-1)
                shifted = torch.sub(z, m[:, None], out=ws.b[: z.shape[0]])
                e = torch.exp(shifted, out=ws.a[: z.shape[0]])  # z is dead now; reuse its buffer
                local[sl, 1] = e.sum(dim=-1)
                local[sl, 2] = row_dot(e, shifted)
                # float32 logits at T = 1 are used in place (z is the chunk itself): drop it
                # before the next chunk is made, or two chunks of logits are live at once
                # beside the workspace (one chunk more than the memory plan counts).
                del z
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
