"""Advantage Reweighting (AR, arXiv 2505.12929): ``A <- (alpha * p_old + 1 - alpha) * A``.

``p_old`` is the OLD (rollout) policy's probability of the token at the rollout
temperature. Applied once per RL step, before any update, to positive and negative
advantages alike, so a low-probability token's advantage shrinks towards
``(1 - alpha) * A``. Stop-gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_rl.algo.methods.base import TokenWeightMethod, pair, register_method
from megatron_rl.config.lib import require_range

__all__ = ["ARConfig", "AdvantageReweighting", "advantage_reweight"]


@dataclass(kw_only=True)
class ARConfig:
    """Advantage Reweighting (arXiv 2505.12929): ``A <- (alpha * p_old + 1 - alpha) * A``."""

    alpha: float = 0.0
    """Reweighting strength in [0, 1]; 0 disables it (plain GRPO). Paper: 0.3 with Lopti,
    0.2 alone (K&K), 0.1 (math)."""

    @property
    def enabled(self) -> bool:
        return self.alpha > 0.0

    def __post_init__(self) -> None:
        require_range("alpha", self.alpha, ge=0.0, le=1.0)


def advantage_reweight(
    advantages: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, alpha: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """AR: scale each token's advantage by ``alpha * p_old + 1 - alpha``.

    Args:
        advantages: ``[*S]`` token advantages (positive and negative alike are scaled).
        old_logp: ``[*S]`` old-policy log-probs at the rollout temperature.
        mask: ``[*S]`` valid response tokens; weights are 0 elsewhere.
        alpha: in [0, 1]; 0 returns the advantages unchanged (bit-exact), i.e. GRPO.

    Returns:
        ``(weighted advantages, weights)``, both ``[*S]``; weights lie in ``[1 - alpha, 1]``
        on valid tokens and carry no gradient.
    """
    valid = mask.bool()
    if alpha == 0.0:
        return advantages, valid.to(advantages.dtype)
    p_old = torch.exp(torch.where(valid, old_logp.detach(), torch.zeros_like(old_logp)))
    weight = torch.where(valid, alpha * p_old + (1.0 - alpha), torch.zeros_like(p_old)).to(advantages.dtype)
    return advantages * weight, weight


@register_method
class AdvantageReweighting(TokenWeightMethod):
    """AR as a token-weight method: reweights the advantages once per RL step."""

    name = "ar"
    config_class = ARConfig

    def reads_old_logp_before_forward(self, section: ARConfig) -> bool:
        return True  # the advantages are reweighted before the loss runs

    def reweight_advantages(self, advantages, old_logp, valid, section: ARConfig):
        adv, weight = advantage_reweight(advantages, old_logp, valid, section.alpha)
        weight = weight.to(torch.float64)
        return adv, {"loss/ar/weight_mean": pair(torch.where(valid, weight, torch.zeros_like(weight)).sum(), valid.sum())}
