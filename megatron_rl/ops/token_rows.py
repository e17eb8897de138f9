"""The loss's token rows: which tokens of a call have a loss, and moving per-token tensors
to and from those rows (the fused lm-head's row selection, ``fused_linear_policy_loss``).

Prompt and padding tokens have no loss and a zero gradient; a training call multiplies
only the rows of the loss's mask through the lm-head. Shapes: ``[*S]`` per-token tensors
in, flat ``[T_sel]`` out (and back to flat ``[T]``).

On CUDA finding the rows (``nonzero``) is one more host synchronisation per call; it pays
there too, since the op already reads the targets back at its start and the GEMMs saved
scale with the share of prompt tokens (``benchmarks/row_select.py``; its numbers are in
docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

import torch

__all__ = ["loss_rows", "scatter_rows", "select_tokens"]


def loss_rows(hidden: torch.Tensor, weight: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
    """The flat indices of the loss's tokens when selecting them pays: a training call
    (gradients) with some, but not all, tokens masked out; else ``None``. (Without
    gradients the caller wants every token's log-prob, masked or not.)"""
    if not (hidden.requires_grad or weight.requires_grad) or not torch.is_grad_enabled():
        return None
    rows = mask.reshape(-1).nonzero().squeeze(1)
    return rows if 0 < rows.numel() < mask.numel() else None


def select_tokens(inputs: Any, rows: torch.Tensor) -> Any:
    """``inputs`` (a ``LossInputs``) with every per-token tensor reduced to the flat ``rows``
    (``[T_sel]``). Sequence ids come along (made first when absent: one sequence per row of
    the last dimension, ``compute_policy_loss``'s default), so the seq-mean modes still
    see the same sequences."""
    mask = inputs.mask
    if inputs.seq_index is None:
        per_seq = max(mask.shape[-1] if mask.dim() else 1, 1)
        inputs = replace(inputs, seq_index=(torch.arange(mask.numel(), device=mask.device) // per_seq).reshape(mask.shape))
    picked = {}
    for f in fields(inputs):
        value = getattr(inputs, f.name)
        if isinstance(value, torch.Tensor):  # every tensor field is per token ([*S])
            picked[f.name] = value.reshape(-1).index_select(0, rows)
    return replace(inputs, **picked)


def scatter_rows(values: torch.Tensor | None, rows: torch.Tensor, num_tokens: int) -> torch.Tensor | None:
    """``[T_sel]`` per-token values back at ``rows`` of a ``[T]`` zero tensor."""
    if values is None:
        return None
    return values.new_zeros(num_tokens).index_copy_(0, rows, values)
