"""The supervised objective of ``megatron-rl sft``: the negative log-likelihood of the
response tokens, under the same aggregation contract as the policy loss.

Per micro-batch ``loss_sum = -sum_t logp_t`` over the valid (response) tokens and
``count`` = their number; the caller sums both over micro-batches and the data-parallel
group and divides once, so the loss is the mean over every response token of the
mini-batch whatever its micro-batch, packing or DP split (the RL loss's ``token_mean``).
The fused vocab-parallel op (``megatron_rl.ops``) computes ``logp`` at temperature 1 and
chains this function's gradient into the logits, as it does for the policy loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from megatron_rl.algo.methods.base import pair
from megatron_rl.algo.policy_loss import LossOutput

__all__ = ["SFT_OBJECTIVE", "SFTObjective", "compute_sft_loss"]


@dataclass(frozen=True)
class SFTObjective:
    """What the fused op and ``MegatronActor.train_step`` take in place of an
    ``AlgorithmConfig`` to train on the response tokens' likelihood: no advantages, old or
    reference log-probs, phases or pre-pass. It has no settings: the objective is fixed."""

    needs_ref_logp: ClassVar[bool] = False
    entropy_coef: ClassVar[float] = 0.0
    """The fused op asks whether the loss depends on the entropy: it does not."""


SFT_OBJECTIVE = SFTObjective()


def compute_sft_loss(logp: torch.Tensor, mask: torch.Tensor) -> LossOutput:
    """Negative log-likelihood of the masked tokens, as a sum plus its normaliser share.

    Args:
        logp: ``[*S]`` log-probs of the target tokens at temperature 1 (differentiable).
        mask: ``[*S]`` tokens to train on (bool or 0/1); values elsewhere are never used,
            NaN included.

    Returns:
        :class:`LossOutput` with ``loss_sum = -sum(logp[mask])``, ``count`` = the masked
        tokens (float64), metrics ``loss/nll`` (mean per token) and ``loss/active_tokens``;
        divide the global sum of ``loss_sum`` by the global sum of ``count``.
    """
    if logp.shape != mask.shape:
        raise ValueError(f"logp and mask must share one shape; got {tuple(logp.shape)}, {tuple(mask.shape)}")
    valid = mask.bool()
    zeros = torch.zeros_like(logp)
    nll = torch.where(valid, -logp, zeros)
    n = valid.sum().to(torch.float64)
    metrics = {"loss/nll": pair(nll.detach().to(torch.float64).sum(), n), "loss/active_tokens": pair(n, 1.0)}
    return LossOutput(loss_sum=nll.sum(), count=n, metrics=metrics, active=valid, counted=valid)
