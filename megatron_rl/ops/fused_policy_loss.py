"""The fused vocab-parallel token-weighted policy loss.

One pass of statistics over TP-sharded logits gives each token's log-prob and entropy
(:mod:`megatron_rl.ops.vocab_parallel`, one all-gather of ``[T, 4]`` on the TP group).
The loss itself is the ``algo/`` loss, run with autograd on those ``[T]`` tensors only:
ONE source of truth for PPO-clip, KL, entropy, AR/Lopti/TR-GRPO/STAPO and aggregation.
Its gradients ``dL/dlogp`` and ``dL/dH`` are then chained into the logits analytically,
chunk by chunk (``dlogp/dz = onehot - p``, ``dH/dz = -p (log p + H)``), rebuilding each
chunk's softmax from the stored per-token max and log-sum-exp. So:

- no ``[T, V]`` float32 buffer beyond one chunk is ever alive, whatever the logits' dtype;
- nothing is gathered across TP, and no collective runs in backward;
- the gradient w.r.t. the logits is computed during forward (when gradients are enabled)
  and only scaled by the incoming gradient in backward.

Fused-linear mode takes the last hidden states and this rank's lm-head shard instead,
and multiplies per chunk, so the logits never exist in full: the extra memory is one
chunk plus the ``[T, H]`` hidden-state gradient. The hidden-state gradient is a partial
sum per vocabulary shard and is all-reduced over the TP group (in forward, once).

Shapes: any leading shape ``[*S]`` for per-token tensors; logits ``[*S, V_local]``,
hidden ``[*S, H]``, lm-head weight ``[V_local, H]``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl.algo.config import AlgorithmConfig
from megatron_rl.algo.mismatch import truncated_is_weights
from megatron_rl.algo.policy_loss import LossOutput, compute_policy_loss
from megatron_rl.algo.sft import SFTObjective, compute_sft_loss
from megatron_rl.ops.token_rows import loss_rows, scatter_rows, select_tokens
from megatron_rl.ops.vocab_parallel import (
    KERNELS,
    ChunkWorkspace,
    SoftmaxStats,
    VocabShard,
    chunk_rows,
    chunk_slices,
    invalid_rows_per_chunk,
    linear_chunk_rows,
    logit_grad_chunk,
    resolve_kernel,
    row_dot,
    softmax_stats,
    tp_rank_and_size,
)


@dataclass(kw_only=True)
class VocabParallelOptions:
    """How the vocab-parallel logits are laid out and processed."""

    temperature: float = 1.0
    """Logits are divided by it (use the rollout temperature so ``logp`` matches the sampler)."""

    tp_group: dist.ProcessGroup | None = None
    """Tensor-parallel group holding the vocabulary shards (``None``: one shard)."""

    vocab_size: int | None = None
    """True global vocabulary size; columns beyond it are TP padding (``None``: no padding)."""

    chunk_tokens: int | None = None
    """Tokens processed per chunk (``None``: by a float32 byte budget per device type: over
    materialised logits 4 MiB on CPU, 256 MiB on CUDA; in the fused lm-head mode 64 MiB on
    CPU, 1 GiB on CUDA; see ``vocab_parallel.chunk_budget_bytes``)."""

    token_grad_norms: bool = False
    """Also compute each token's ``||dL/dlogits_t||`` (of the loss SUM, whole vocabulary) into
    ``SoftmaxStats.logit_grad_norm``, for the token-probability diagnostics: one extra
    in-cache pass per chunk and one all-reduce of ``[T]`` on the TP group."""

    grad_in_place: bool = True
    """Scale the precomputed logit gradient in place in backward (not at all when the
    incoming gradient is exactly 1), so no second logits-sized buffer is allocated; allows
    one backward per forward. ``False`` allocates the scaled gradient instead and allows
    repeated backward (``retain_graph``, ``gradcheck``)."""

    kernel: str = "auto"
    """The passes over the logits: ``torch`` (chunked torch ops), ``triton`` (one read per
    pass, ``ops.triton_kernels``; CUDA) or ``auto`` (Triton on CUDA when it imports and the
    logits are not float64); see ``vocab_parallel.resolve_kernel``."""

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {self.kernel!r}")


@dataclass
class LossInputs:
    """Per-token inputs of the loss, all ``[*S]`` (see ``compute_policy_loss``)."""

    targets: torch.Tensor
    old_logp: torch.Tensor | None
    """Old-policy log-probs; ``None``: the logits are the old policy's own (an on-policy
    update's first optimizer step), so the old log-probs are the current ones, detached,
    and the ratio is exactly 1."""
    advantages: torch.Tensor | None
    """Token advantages (reweighting applied); ``None`` for the SFT objective, which has none."""
    mask: torch.Tensor
    ref_logp: torch.Tensor | None = None
    phase: str | None = None
    """The update phase (``algo.update_phases``), ``None`` without phases."""
    prepass: Mapping[str, torch.Tensor] | None = None
    """Mini-batch statistics of the pre-pass (``algo.prepass_statistics``), if any."""
    seq_index: torch.Tensor | None = None
    engine_logp: torch.Tensor | None = None
    """With ``tis_cap`` and ``old_logp is None``: the engines' log-probs, so the truncated
    importance weights (``algo.truncated_is_weights``) come from this forward's own
    detached log-probs, the old policy's, and multiply the advantages inside the loss."""
    tis_cap: float | None = None
    """The weights' cap (``rollout.tis_cap``); used only with ``engine_logp``."""

    def __post_init__(self) -> None:
        if self.engine_logp is not None and (self.old_logp is not None or self.tis_cap is None):
            raise ValueError("LossInputs.engine_logp is for an on-policy step's TIS: old_logp None and tis_cap set")


# ----------------------------------------------------------------------------- forward-only


@torch.no_grad()
def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    options: VocabParallelOptions | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Target log-probs and full-distribution entropies from vocab-parallel logits.

    Args:
        logits: ``[*S, V_local]`` this rank's vocabulary shard (any float dtype).
        targets: ``[*S]`` global target ids; masked-out positions may hold anything (-100).
        mask: ``[*S]`` tokens to compute (default all); others return 0.
        options: temperature, TP group (one all-gather), vocab padding, chunking.

    Returns:
        ``(logp, entropy)``, float32 ``[*S]``, identical on all ranks of the TP group.
    """
    options = options or VocabParallelOptions()
    flat = logits.reshape(-1, logits.shape[-1])
    kernel = resolve_kernel(options.kernel, logits)
    stats = _stats(lambda sl: flat[sl], targets, mask, flat.shape[-1], options, logits.dtype, kernel=kernel)
    return stats.logp.reshape(targets.shape), stats.entropy.reshape(targets.shape)


@torch.no_grad()
def vocab_parallel_logprobs_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    options: VocabParallelOptions | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`vocab_parallel_logprobs` from hidden states ``[*S, H]`` and the lm-head shard
    ``[V_local, H]``, multiplying chunk by chunk (the logits never exist in full)."""
    options = _linear_options(options or VocabParallelOptions(), hidden, weight)
    h = hidden.reshape(-1, hidden.shape[-1])
    kernel = resolve_kernel(options.kernel, hidden)
    stats = _stats(lambda sl: h[sl] @ weight.t(), targets, mask, weight.shape[0], options, hidden.dtype, kernel=kernel)
    return stats.logp.reshape(targets.shape), stats.entropy.reshape(targets.shape)


def _stats(
    chunk_logits, targets, mask, vocab_local, options: VocabParallelOptions, dtype, workspace=None, kernel="torch"
) -> SoftmaxStats:
    flat_targets = targets.reshape(-1).long()
    valid = torch.ones_like(flat_targets, dtype=torch.bool) if mask is None else mask.reshape(-1).bool()
    return softmax_stats(
        chunk_logits,
        flat_targets,
        valid,
        vocab_local=vocab_local,
        temperature=options.temperature,
        tp_group=options.tp_group,
        vocab_size=options.vocab_size,
        chunk_tokens=options.chunk_tokens,
        compute_dtype=compute_dtype(dtype),
        workspace=workspace,
        kernel=kernel,
    )


def _workspace(
    num_tokens: int, vocab_local: int, options: VocabParallelOptions, dtype, device, kernel: str = "torch"
) -> ChunkWorkspace | None:
    """One workspace shared by the torch kernel's stats and gradient passes (``None`` for a
    padding-only rank, and for the Triton kernels, which need none)."""
    shard = VocabShard.of(vocab_local, options.tp_group, options.vocab_size)
    if shard.num_valid == 0 or kernel == "triton":
        return None
    rows = chunk_rows(num_tokens, vocab_local, options.chunk_tokens, device)
    return ChunkWorkspace(rows, shard.num_valid, compute_dtype(dtype), device)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 inputs, float32 for everything narrower (bf16, fp16, fp32)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------- the loss on [T]


def _loss_on_tokens(
    stats: SoftmaxStats, inputs: LossInputs, config: AlgorithmConfig | SFTObjective, need_grad: bool
) -> tuple[LossOutput, torch.Tensor | None, torch.Tensor | None]:
    """Run the ``algo/`` loss with autograd on the ``[T]`` log-probs and entropies.

    Returns the loss output (``loss_sum`` detached) and ``dL/dlogp``, ``dL/dH`` (``[T]``
    float32; ``dL/dH`` is ``None`` when the loss does not depend on the entropy).
    """
    shape = inputs.targets.shape
    logp = stats.logp.reshape(shape).detach().requires_grad_(need_grad)
    entropy = stats.entropy.reshape(shape).detach()
    entropy_needs_grad = need_grad and config.entropy_coef > 0.0
    entropy.requires_grad_(entropy_needs_grad)
    with torch.enable_grad():
        if isinstance(config, SFTObjective):
            out = compute_sft_loss(logp, inputs.mask)
        else:
            old_logp = logp.detach() if inputs.old_logp is None else inputs.old_logp.to(logp.dtype)
            if inputs.advantages is None:
                raise ValueError("the policy loss needs inputs.advantages")
            advantages = inputs.advantages.to(logp.dtype)
            if inputs.engine_logp is not None:  # the old log-probs exist only now: TIS applies here
                tis = truncated_is_weights(old_logp, inputs.engine_logp, inputs.mask, inputs.tis_cap)
                advantages = advantages * tis.to(logp.dtype)
            out = compute_policy_loss(
                logp,
                old_logp,
                advantages,
                inputs.mask,
                config,
                ref_logp=None if inputs.ref_logp is None else inputs.ref_logp.to(logp.dtype),
                entropy=entropy,
                phase=inputs.phase,
                prepass=inputs.prepass,
                seq_index=inputs.seq_index,
            )
        grad_logp = grad_entropy = None
        if need_grad:
            wrt = [logp, entropy] if entropy_needs_grad else [logp]
            grads = torch.autograd.grad(out.loss_sum, wrt, allow_unused=True)
            grad_logp = grads[0] if grads[0] is not None else torch.zeros_like(logp)
            grad_logp = grad_logp.reshape(-1)
            if entropy_needs_grad and grads[1] is not None:
                grad_entropy = grads[1].reshape(-1)
    out.loss_sum = out.loss_sum.detach()
    return out, grad_logp, grad_entropy


class _FusedPolicyLoss(torch.autograd.Function):
    """Loss sum from logits ``[T, V_local]``; the logit gradient is built during forward."""

    @staticmethod
    def forward(ctx, logits, inputs: LossInputs, config: AlgorithmConfig | SFTObjective, options: VocabParallelOptions, holder):
        flat = logits.reshape(-1, logits.shape[-1])
        kernel = resolve_kernel(options.kernel, flat)
        ws = _workspace(flat.shape[0], flat.shape[-1], options, logits.dtype, logits.device, kernel)
        chunk = lambda sl: flat[sl]  # noqa: E731
        stats = _stats(chunk, inputs.targets, inputs.mask, flat.shape[-1], options, logits.dtype, ws, kernel)
        need_grad = logits.requires_grad
        out, g_logp, g_ent = _loss_on_tokens(stats, inputs, config, need_grad)
        holder["output"] = out
        holder["stats"] = stats
        if need_grad:
            grad = torch.empty_like(flat)
            num_valid = VocabShard.of(flat.shape[-1], options.tp_group, options.vocab_size).num_valid
            # Write straight into the gradient: Triton in any dtype, torch in the compute dtype.
            direct = kernel == "triton" or grad.dtype == compute_dtype(logits.dtype)
            for sl, g in _grad_chunks(
                chunk, stats, inputs, g_logp, g_ent, flat.shape[-1], options, ws, out=grad if direct else None,
                kernel=kernel,
            ):  # fmt: skip
                if g is None:
                    grad[sl] = 0
                elif not direct:
                    grad[sl, :num_valid].copy_(g)
            if num_valid < flat.shape[-1]:
                grad[:, num_valid:] = 0  # TP padding columns take no part in the loss
            ctx.save_for_backward(grad)
            ctx.logits_shape = logits.shape
            ctx.in_place = options.grad_in_place
            ctx.backward_done = False
        return out.loss_sum.clone()

    @staticmethod
    def backward(ctx, grad_output):
        # The gradient buffer is scaled in place: a second backward (retain_graph=True)
        # would scale it twice, so refuse it rather than return a wrong gradient.
        if ctx.backward_done and ctx.in_place:
            raise RuntimeError(
                "fused_policy_loss supports one backward per forward with grad_in_place=True "
                "(set VocabParallelOptions(grad_in_place=False) for retain_graph)"
            )
        ctx.backward_done = True
        (grad,) = ctx.saved_tensors
        scale = grad_output.to(grad.dtype)
        if ctx.in_place:
            # ``loss_sum.backward()`` (what megatron's per-token loss does) passes exactly 1:
            # one host read here saves a read and a write of the whole gradient.
            if not bool(scale == 1):
                grad.mul_(scale)
        else:
            grad = grad * scale
        return grad.reshape(ctx.logits_shape), None, None, None, None


class _ChunkLogits:
    """``h[rows] @ W^T``, the logits of a chunk of tokens, for the two passes of the fused
    lm-head mode. When one chunk holds every token (always with the Triton kernels; on CPU
    whenever ``[T, V_local]`` fits the 64 MiB budget) the statistics pass keeps its logits
    and the gradient pass takes them instead of multiplying again: one ``[T, H] x [H, V]``
    matmul less, and no extra memory (the gradient pass would allocate the same tensor).
    The kept tensor is unchanged by the statistics pass (it never writes into the logits),
    so the result is bitwise the recomputation's."""

    def __init__(self, h: torch.Tensor, weight: torch.Tensor):
        self.h, self.weight = h, weight
        self._kept: torch.Tensor | None = None

    def __call__(self, sl: slice) -> torch.Tensor:
        if self._kept is not None and sl.start == 0 and sl.stop == self.h.shape[0]:
            kept, self._kept = self._kept, None
            return kept
        return self.h[sl] @ self.weight.t()

    def keeping_whole(self, sl: slice) -> torch.Tensor:
        """The statistics pass's chunks when a gradient pass follows; a chunk of every token
        is kept for it (a forward-only call drops each chunk after use, as before)."""
        logits = self(sl)
        if sl.start == 0 and sl.stop == self.h.shape[0]:
            self._kept = logits
        return logits


class _FusedLinearPolicyLoss(torch.autograd.Function):
    """Loss sum from hidden ``[T, H]`` and the lm-head shard ``[V_local, H]``."""

    @staticmethod
    def forward(ctx, hidden, weight, inputs: LossInputs, config, options: VocabParallelOptions, holder, main_grad):
        h = hidden.reshape(-1, hidden.shape[-1])
        chunk = _ChunkLogits(h, weight)
        kernel = resolve_kernel(options.kernel, h)
        ws = _workspace(h.shape[0], weight.shape[0], options, hidden.dtype, hidden.device, kernel)
        need_grad = hidden.requires_grad or weight.requires_grad
        stats = _stats(chunk.keeping_whole if need_grad else chunk, inputs.targets, inputs.mask, weight.shape[0],
                       options, hidden.dtype, ws, kernel)  # fmt: skip
        out, g_logp, g_ent = _loss_on_tokens(stats, inputs, config, need_grad)
        holder["output"] = out
        holder["stats"] = stats
        if need_grad:
            acc = compute_dtype(hidden.dtype)
            grad_h = torch.zeros(h.shape, dtype=acc, device=h.device) if hidden.requires_grad else None
            grad_w = None
            if main_grad is not None:
                grad_w = main_grad  # accumulate in place, like megatron's gradient_accumulation_fusion
            elif weight.requires_grad:
                grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device)
            num_valid = VocabShard.of(weight.shape[0], options.tp_group, options.vocab_size).num_valid
            w_valid = weight[:num_valid]
            for sl, g in _grad_chunks(
                chunk, stats, inputs, g_logp, g_ent, weight.shape[0], options, ws, kernel=kernel
            ):  # fmt: skip
                if g is None:
                    continue
                # The matmuls run in the input dtype (bf16 on GPUs) accumulating in float32,
                # like megatron's own output layer; float32 inputs are unchanged.
                g_in = g.to(hidden.dtype)
                if g_in.dtype == acc:  # float32/float64: in place, no temporaries
                    if grad_h is not None:
                        torch.matmul(g_in, w_valid, out=grad_h[sl])
                    if grad_w is not None:
                        grad_w[:num_valid].addmm_(g_in.t(), h[sl])
                    continue
                if grad_h is not None:
                    _mm_f32(g_in, w_valid, out=grad_h[sl])
                if grad_w is not None:
                    _addmm_f32(grad_w[:num_valid], g_in.t(), h[sl])
            _, tp_size = tp_rank_and_size(options.tp_group)
            if grad_h is not None and tp_size > 1:
                # Each rank's vocabulary shard contributes a partial dL/dh: sum them.
                dist.all_reduce(grad_h, group=options.tp_group)
            ctx.save_for_backward(
                grad_h.to(hidden.dtype) if grad_h is not None else None,
                grad_w.to(weight.dtype) if grad_w is not None and main_grad is None else None,
            )
            ctx.hidden_shape = hidden.shape
        return out.loss_sum.clone()

    @staticmethod
    def backward(ctx, grad_output):
        grad_h, grad_w = ctx.saved_tensors
        if grad_h is not None:
            grad_h = (grad_h * grad_output.to(grad_h.dtype)).reshape(ctx.hidden_shape)
        if grad_w is not None:
            grad_w = grad_w * grad_output.to(grad_w.dtype)
        return grad_h, grad_w, None, None, None, None, None


def _mm_f32(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor) -> None:
    """``out = a @ b``: inputs in their (16-bit) dtype, float32 accumulation and ``out``;
    on CUDA written by the GEMM itself (no temporary)."""
    if a.is_cuda:
        torch.mm(a, b, out_dtype=torch.float32, out=out)
    else:
        out.copy_(a @ b)


def _addmm_f32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` into a float32 ``acc`` (megatron's ``main_grad``). On CUDA the GEMM
    accumulates into ``acc`` itself (beta = 1): one read and one write of the ``[V, H]``
    buffer per chunk instead of a float32 product the size of the weight plus an add."""
    if a.is_cuda:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc += (a @ b).float()


def _grad_chunks(
    chunk_logits, stats, inputs: LossInputs, g_logp, g_ent, vocab_local, options, ws, out=None, kernel="torch"
):
    """Yield ``(token slice, dL/dlogits of the chunk's real columns)`` over all tokens.

    torch kernel: the gradient is ``[n, V_valid]`` in the compute dtype (written into
    ``out[sl, :V_valid]`` when ``out`` is given), with masked-out rows zeroed; ``None`` on
    a padding-only rank. Each yielded tensor is only valid until the next one (it may live
    in ``ws``). The loop does not synchronise with the device: which chunks hold masked-out
    tokens is found once, before it (:func:`invalid_rows_per_chunk`).

    Triton kernel: one launch per chunk (all tokens in one chunk when ``chunk_tokens`` is
    ``None``), masked-out rows zeroed in the kernel; the gradient goes into ``out[sl]``
    (its whole width, TP padding columns zeroed) when ``out`` is given, else over the
    chunk's logits themselves (the fused lm-head mode's fresh ``h @ W^T``), in their dtype.
    """
    shard = VocabShard.of(vocab_local, options.tp_group, options.vocab_size)
    targets = inputs.targets.reshape(-1).long()
    valid = inputs.mask.reshape(-1).bool()
    num_tokens = targets.shape[0]
    if shard.num_valid == 0:
        for sl in chunk_slices(num_tokens, chunk_rows(num_tokens, vocab_local, options.chunk_tokens, targets.device)):
            yield sl, None
        if options.token_grad_norms:  # still take part in the all-reduce
            _finish_grad_norms(stats, torch.zeros(num_tokens, dtype=stats.logp.dtype, device=targets.device), options)
        return
    inv_t = 1.0 / options.temperature
    local_target = targets - shard.start
    owned = valid & (local_target >= 0) & (local_target < shard.num_valid)
    tgt_local = local_target.clamp(0, shard.num_valid - 1)[:, None]
    owned_grad = torch.where(owned, g_logp * inv_t, 0.0)
    if g_ent is None:  # dL/dz = g_logp (onehot - p)
        row_scale, row_shift = -g_logp * inv_t, None
    else:  # ... - g_H p (log p + H)
        row_scale, row_shift = -g_ent * inv_t, -(g_logp + g_ent * stats.entropy) * inv_t
    sq_norm = (
        torch.zeros(num_tokens, dtype=stats.logp.dtype, device=targets.device) if options.token_grad_norms else None
    )
    if kernel == "triton":
        from megatron_rl.ops import triton_kernels

        for sl in chunk_slices(num_tokens, chunk_rows(num_tokens, vocab_local, options.chunk_tokens, kernel=kernel)):
            x = chunk_logits(sl)[:, : shard.num_valid]
            g = x if out is None else out[sl]
            triton_kernels.row_grad(
                x, g, log_normalizer=stats.log_normalizer[sl], row_scale=row_scale[sl],
                row_shift=None if row_shift is None else row_shift[sl], target_cols=tgt_local[sl, 0],
                target_grad=owned_grad[sl], valid=valid[sl], inv_t=inv_t,
                sq_norm=None if sq_norm is None else sq_norm[sl],
            )  # fmt: skip
            yield sl, g
        _finish_grad_norms(stats, sq_norm, options)
        return
    slices = chunk_slices(num_tokens, ws.rows)  # the workspace's rows are the chunk size
    invalid_rows = invalid_rows_per_chunk(valid, ws.rows)  # one host read, not one per chunk
    for sl, invalid in zip(slices, invalid_rows, strict=True):
        g = logit_grad_chunk(
            chunk_logits(sl)[:, : shard.num_valid], sl, stats, tgt_local, owned_grad, row_scale, row_shift,
            inv_t=inv_t, workspace=ws, out=None if out is None else out[sl, : shard.num_valid],
        )  # fmt: skip
        if invalid is not None:  # assignment, not multiplication: padding rows may hold NaN
            g.index_fill_(0, invalid, 0)  # only those rows (a boolean-mask assignment would sync on CUDA)
        if sq_norm is not None:
            sq_norm[sl] = row_dot(g, g)
        yield sl, g
    if sq_norm is not None:
        _finish_grad_norms(stats, sq_norm, options)


def _finish_grad_norms(stats: SoftmaxStats, sq_norm: torch.Tensor | None, options: VocabParallelOptions) -> None:
    """Sum the per-shard squared norms over the TP group (all-reduce) into ``stats``."""
    if sq_norm is None:
        return
    _, tp_size = tp_rank_and_size(options.tp_group)
    if tp_size > 1:
        dist.all_reduce(sq_norm, group=options.tp_group)
    stats.logit_grad_norm = sq_norm.sqrt()


# ----------------------------------------------------------------------------- public API


def fused_policy_loss(
    logits: torch.Tensor,
    inputs: LossInputs,
    config: AlgorithmConfig | SFTObjective,
    options: VocabParallelOptions | None = None,
) -> tuple[LossOutput, SoftmaxStats]:
    """Token-weighted policy loss straight from vocab-parallel logits.

    Args:
        logits: ``[*S, V_local]`` this rank's vocabulary shard; any float dtype (the math
            runs in float32 per chunk), differentiable.
        inputs: targets, old/ref log-probs, advantages (reweighting applied), mask, the
            update phase, pre-pass statistics, sequence ids; per-token tensors ``[*S]``.
        config: the ``algorithm`` config (the loss math is ``algo.compute_policy_loss``), or
            ``algo.sft.SFT_OBJECTIVE`` for the response tokens' negative log-likelihood
            (``algo.sft.compute_sft_loss``; only ``targets`` and ``mask`` are read).
        options: temperature, TP group, vocab padding, chunk size.

    Returns:
        ``(LossOutput, SoftmaxStats)``: ``loss_sum`` differentiable w.r.t. ``logits``, ``count``
        and metrics as in ``compute_policy_loss`` (identical on every TP rank); the
        per-token log-probs and entropies (flattened ``[T]``, float32; float64 for float64 logits).
    """
    options = options or VocabParallelOptions()
    _check_shapes(logits.shape[:-1], inputs)
    holder: dict[str, Any] = {}
    loss_sum = _FusedPolicyLoss.apply(logits, inputs, config, options, holder)
    out: LossOutput = holder["output"]
    out.loss_sum = loss_sum
    return out, holder["stats"]


def fused_linear_policy_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    inputs: LossInputs,
    config: AlgorithmConfig | SFTObjective,
    options: VocabParallelOptions | None = None,
    *,
    weight_main_grad: torch.Tensor | None = None,
    loss_rows_only: bool = True,
) -> tuple[LossOutput, SoftmaxStats]:
    """:func:`fused_policy_loss` from hidden states ``[*S, H]`` and the lm-head shard
    ``[V_local, H]``; differentiable w.r.t. both. The hidden-state gradient is summed over
    the TP group (all-reduce in forward); the weight gradient is this shard's own.

    ``weight_main_grad``: a preallocated ``[V_local, H]`` buffer (megatron DDP's
    ``main_grad``) into which ``dL/dW`` is accumulated during forward, UNSCALED by the
    upstream gradient (call ``backward`` on ``loss_sum`` itself and divide by the global
    count afterwards, as megatron's ``calculate_per_token_loss`` does); the weight then
    gets no ``.grad`` from this op. Saves a weight-sized temporary.

    With gradients, only the tokens of ``inputs.mask`` go through the lm-head (the rest,
    prompt and padding, have no loss and a zero gradient): their rows are selected first
    (one host read of the mask, ``ops/token_rows.py``) and the statistics scattered back,
    zeros elsewhere (``SoftmaxStats``). ``loss_rows_only=False`` computes every row
    instead (no host read: for CUDA graph capture, and the baseline of
    ``benchmarks/row_select.py``).
    """
    _check_shapes(hidden.shape[:-1], inputs)
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be [V_local, {hidden.shape[-1]}], got {tuple(weight.shape)}")
    if weight_main_grad is not None and weight_main_grad.shape != weight.shape:
        raise ValueError(f"weight_main_grad shape {tuple(weight_main_grad.shape)} != weight {tuple(weight.shape)}")
    num_tokens = inputs.mask.numel()
    rows = loss_rows(hidden, weight, inputs.mask) if loss_rows_only else None
    if rows is not None:
        hidden = hidden.reshape(num_tokens, -1).index_select(0, rows)  # its backward scatters dL/dh back
        inputs = select_tokens(inputs, rows)
    options = _linear_options(options or VocabParallelOptions(), hidden, weight)
    holder: dict[str, Any] = {}
    loss_sum = _FusedLinearPolicyLoss.apply(hidden, weight, inputs, config, options, holder, weight_main_grad)
    out: LossOutput = holder["output"]
    out.loss_sum = loss_sum
    stats: SoftmaxStats = holder["stats"]
    if rows is not None:
        stats = SoftmaxStats(**{f.name: scatter_rows(getattr(stats, f.name), rows, num_tokens) for f in fields(stats)})
    return out, stats


def _linear_options(options: VocabParallelOptions, hidden: torch.Tensor, weight: torch.Tensor) -> VocabParallelOptions:
    """The fused lm-head mode's chunking: large chunks unless given (see ``LINEAR_CHUNK_BYTES``)."""
    if options.chunk_tokens is not None:
        return options
    num_tokens = hidden.numel() // max(hidden.shape[-1], 1)
    return replace(options, chunk_tokens=linear_chunk_rows(num_tokens, weight.shape[0], hidden.device))


def _check_shapes(token_shape: torch.Size, inputs: LossInputs) -> None:
    for name in ("targets", "old_logp", "advantages", "mask", "ref_logp", "seq_index"):
        t = getattr(inputs, name)
        if t is not None and t.shape != token_shape:
            raise ValueError(
                f"inputs.{name} has shape {tuple(t.shape)}; the logits' token shape is {tuple(token_shape)}"
            )
