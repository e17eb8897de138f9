"""TR-GRPO (arXiv 2511.00066): ``w = clip(alpha * (sigmoid(p / tau) - mu), L, U)``.

``p`` is the CURRENT policy's token probability, with no gradient through ``w``; the
weight grows with ``p``, so low-probability tokens pull less. It applies inside the
clipped objective (``placement: ratio``, ``min(w r A, clip(w r) A)`` as in the paper, and
on the KL term) or multiplies the per-token loss (``loss``). The paper's constants are
not public; the defaults are ours (docs/algorithms.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from megatron_rl.algo.methods.base import TokenWeight, TokenWeightMethod, register_method
from megatron_rl.config.lib import ConfigError, check_literals, require_range

__all__ = ["TRGRPO", "TRGRPOConfig", "tr_grpo_weight"]


@dataclass(kw_only=True)
class TRGRPOConfig:
    """TR-GRPO (arXiv 2511.00066): ``w = clip(alpha * (sigmoid(p / tau) - mu), L, U)``.

    ``p`` is the CURRENT policy's token probability, with no gradient through ``w``.
    The paper's constants are not public; these defaults are ours (docs/algorithms.md).
    """

    enabled: bool = False
    """Weight each token by an increasing function of its current probability."""

    alpha: float | None = None
    """Scale; ``None`` picks ``1 / (sigmoid(1 / tau) - mu)`` so that ``w(p=1) = 1`` before clipping."""

    tau: float = 1.0
    """Temperature of the sigmoid, > 0."""

    mu: float = 0.5
    """Offset subtracted from the sigmoid; 0.5 makes ``w(p=0) = 0`` before clipping."""

    lower: float = 0.1
    """``L``: the smallest weight, so no token's gradient is silenced entirely."""

    upper: float = 1.0
    """``U``: the largest weight."""

    placement: Literal["ratio", "loss"] = "ratio"
    """``ratio``: inside the clipped objective, ``min(w r A, clip(w r) A)`` as in the paper
    (and on the KL term); ``loss``: multiply the per-token loss (PG + KL) by ``w``."""

    def __post_init__(self) -> None:
        check_literals(self)
        require_range("tau", self.tau, gt=0.0)
        require_range("lower", self.lower, ge=0.0)
        if self.upper < self.lower:
            raise ConfigError("upper", f"got {self.upper!r}; must be >= lower ({self.lower!r})")
        if self.alpha is None and self.resolved_alpha() <= 0.0:
            raise ConfigError("mu", f"got {self.mu!r}; with alpha unset, mu must be < sigmoid(1 / tau)")

    def resolved_alpha(self) -> float:
        """``alpha``, or the value giving ``w(p=1) = 1`` when it is unset."""
        if self.alpha is not None:
            return self.alpha
        sig = 1.0 / (1.0 + math.exp(-1.0 / self.tau))
        return 1.0 / (sig - self.mu) if sig != self.mu else float("inf")


def tr_grpo_weight(logp: torch.Tensor, config: TRGRPOConfig) -> torch.Tensor:
    """TR-GRPO token weight ``clip(alpha * (sigmoid(p / tau) - mu), L, U)``, no gradient.

    Args:
        logp: ``[*S]`` CURRENT policy log-probs (detached here).

    Returns:
        ``[*S]`` weights in ``[lower, upper]``, non-decreasing in ``p``.
    """
    p = torch.exp(logp.detach())
    w = config.resolved_alpha() * (torch.sigmoid(p / config.tau) - config.mu)
    return w.clamp(min=config.lower, max=config.upper)


@register_method
class TRGRPO(TokenWeightMethod):
    """TR-GRPO as a token-weight method: a weight of the current probability."""

    name = "tr_grpo"
    config_class = TRGRPOConfig

    def token_weight(self, tokens, section: TRGRPOConfig):
        weight = tr_grpo_weight(tokens.logp, section)
        return TokenWeight(weight=weight, placement=section.placement, metric="loss/tr_grpo/weight_mean")
