"""Low-Probability Token Isolation (Lopti, arXiv 2505.12929): two update passes, low first.

The valid tokens are split by the OLD policy's probability, ``low = p_old < eta``
(strict), ``high`` the rest; each RL step's update runs a full pass over the
mini-batches on the low tokens, then one on the high tokens, each with its own optimizer
steps. The normaliser counts all valid tokens (the paper's code) or only the phase's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from megatron_rl.algo.methods.base import TokenWeightMethod, pair, register_method
from megatron_rl.config.lib import check_literals, require_range

__all__ = ["Lopti", "LoptiConfig", "lopti_split"]


@dataclass(kw_only=True)
class LoptiConfig:
    """Low-Probability Token Isolation (arXiv 2505.12929): two update passes, low first."""

    enabled: bool = False
    """Split each RL step into a low-probability pass and a high-probability pass."""

    eta: float = 0.5
    """Threshold on the old-policy token probability: low iff ``p_old < eta`` (strict).
    Paper: 0.5 with AR, 0.4 alone."""

    denominator: Literal["all", "phase"] = "all"
    """Token count that normalises each pass: ``all`` valid response tokens (the paper's
    code) or only the ``phase``'s own tokens."""

    def __post_init__(self) -> None:
        check_literals(self)
        require_range("eta", self.eta, gt=0.0, lt=1.0)


def lopti_split(old_logp: torch.Tensor, mask: torch.Tensor, eta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Lopti's partition of the valid tokens: ``low = p_old < eta`` (strict), ``high`` the rest.

    Returns:
        ``(low, high)`` bool ``[*S]``; disjoint, and their union is exactly ``mask``.
    """
    valid = mask.bool()
    # Compare probabilities (in float64), not log-probs against log(eta), so the boundary
    # ``p_old == eta`` falls in "high" exactly as the paper's strict ``p < eta``.
    low = valid & (torch.exp(old_logp.detach().to(torch.float64)) < eta)
    return low, valid & ~low


@register_method
class Lopti(TokenWeightMethod):
    """Lopti as a token-weight method: a low-probability pass first, then a high-probability pass."""

    name = "lopti"
    config_class = LoptiConfig

    def phases(self, section: LoptiConfig) -> tuple[str, ...]:
        return ("low", "high")

    def select(self, tokens, section: LoptiConfig, phase, prepass):
        low, high = lopti_split(tokens.old_logp, tokens.valid, section.eta)
        part = low if phase == "low" else high
        tokens.active = tokens.active & part
        tokens.masks["lopti/phase"] = part
        if section.denominator == "phase":
            tokens.counted = tokens.counted & part
        tokens.metrics["loss/lopti/low_frac"] = pair(low.sum(), tokens.num_valid)
