"""STAPO (arXiv 2602.15620): silence spurious tokens, ``A > 0``, ``p < tau_p`` and ``H < tau_h``.

``p`` and ``H`` are the CURRENT policy's probability and full-distribution entropy;
``tau_h`` is the ``entropy_quantile`` of the entropy over the candidate tokens
``{A > 0, p < tau_p}`` of the whole mini-batch. A quantile over the mini-batch is not
known to one micro-batch, so STAPO asks for a forward-only pre-pass of the current policy
(within one optimizer step the weights do not change, so its entropies equal those inside
the loss). Silenced tokens leave both the loss and its normaliser.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_rl.algo.methods.base import TokenWeightMethod, pair, register_method
from megatron_rl.config.lib import require_range

__all__ = [
    "STAPO",
    "STAPOConfig",
    "STAPO_THRESHOLD_KEY",
    "stapo_candidates",
    "stapo_entropy_threshold",
    "stapo_spurious_mask",
]

STAPO_THRESHOLD_KEY = "stapo/entropy_threshold"
"""Pre-pass statistic: STAPO's ``tau_h`` over the whole mini-batch (0-dim float64)."""


@dataclass(kw_only=True)
class STAPOConfig:
    """STAPO (arXiv 2602.15620): silence spurious tokens (A > 0, p < tau_p, H < tau_h)."""

    enabled: bool = False
    """Mask spurious tokens out of the loss and renormalise over the kept tokens."""

    tau_p: float = 0.002
    """Absolute probability threshold (strict ``p < tau_p``) on the current policy."""

    entropy_quantile: float = 0.75
    """``q``: ``tau_h`` is this quantile of entropy over the candidate tokens
    ``{A > 0, p < tau_p}`` of the mini-batch (strict ``H < tau_h``). 0.75 or 0.80 in the paper."""

    def __post_init__(self) -> None:
        require_range("tau_p", self.tau_p, gt=0.0, le=1.0)
        require_range("entropy_quantile", self.entropy_quantile, ge=0.0, le=1.0)


def stapo_candidates(
    advantages: torch.Tensor, logp: torch.Tensor, mask: torch.Tensor, tau_p: float
) -> torch.Tensor:
    """STAPO candidate tokens ``{valid, A > 0, p < tau_p}`` (strict), bool ``[*S]``."""
    p = torch.exp(logp.detach())
    return mask.bool() & (advantages > 0) & (p < tau_p)


def _quantile_linear(values: torch.Tensor, q: float) -> torch.Tensor:
    """``q``-quantile with linear interpolation (numpy's default); no size limit unlike torch.quantile."""
    v, _ = torch.sort(values.to(torch.float64))
    pos = q * (v.numel() - 1)
    lo = int(pos)
    hi = min(lo + 1, v.numel() - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def stapo_entropy_threshold(
    entropy: torch.Tensor,
    candidates: torch.Tensor,
    quantile: float,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """``tau_h``: the ``quantile`` of entropy over the candidate tokens of the mini-batch.

    The mini-batch may be spread over the ranks of ``group`` (data-parallel ranks holding
    different responses of the same optimizer step): candidate entropies are all-gathered
    over ``group`` so every rank gets the same threshold. Call it once per mini-batch,
    before the micro-batch loop.

    Args:
        entropy: ``[*S]`` current-policy entropy.
        candidates: ``[*S]`` bool, from :func:`stapo_candidates`.
        quantile: ``q`` in [0, 1].
        group: process group to gather over (all-gather); ``None`` = local tensors only.

    Returns:
        0-dim float64 tensor; ``-inf`` when there are no candidates (then nothing is masked).
    """
    local = entropy.detach()[candidates.bool()].to(torch.float64).reshape(-1)
    if group is not None and dist.get_world_size(group) > 1:
        size = torch.tensor([local.numel()], dtype=torch.int64, device=local.device)
        sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size(group))]
        dist.all_gather(sizes, size, group=group)
        max_size = int(max(int(s) for s in sizes))
        padded = torch.zeros(max_size, dtype=torch.float64, device=local.device)
        padded[: local.numel()] = local
        gathered = [torch.zeros_like(padded) for _ in sizes]
        dist.all_gather(gathered, padded, group=group)
        local = torch.cat([g[: int(s)] for g, s in zip(gathered, sizes)])
    if local.numel() == 0:
        return torch.tensor(float("-inf"), dtype=torch.float64)
    return _quantile_linear(local, quantile)


def stapo_spurious_mask(
    candidates: torch.Tensor, entropy: torch.Tensor, entropy_threshold: torch.Tensor | float
) -> torch.Tensor:
    """Tokens STAPO silences: candidates with ``H < tau_h`` (strict), bool ``[*S]``."""
    tau_h = torch.as_tensor(entropy_threshold, dtype=torch.float64)
    return candidates.bool() & (entropy.detach().to(torch.float64) < tau_h)


@register_method
class STAPO(TokenWeightMethod):
    """STAPO as a token-weight method: a pre-pass threshold, then a mask inside the loss."""

    name = "stapo"
    config_class = STAPOConfig

    def needs_entropy(self, section: STAPOConfig) -> bool:
        return True

    def needs_prepass(self, section: STAPOConfig) -> bool:
        # tau_h is a quantile over the whole mini-batch, which one micro-batch does not see.
        return True

    def prepass_statistics(self, section: STAPOConfig, parts, group):
        entropies = []
        for tokens in parts:
            candidates = stapo_candidates(tokens.advantages, tokens.logp, tokens.active, section.tau_p)
            entropies.append(tokens.entropy[candidates])
        flat = torch.cat(entropies)
        threshold = stapo_entropy_threshold(
            flat, torch.ones_like(flat, dtype=torch.bool), section.entropy_quantile, group=group
        )
        return {STAPO_THRESHOLD_KEY: threshold}

    def select(self, tokens, section: STAPOConfig, phase, prepass):
        if tokens.entropy is None:
            raise ValueError("STAPO needs the current-policy entropy: pass entropy=")
        cand = stapo_candidates(tokens.advantages, tokens.logp, tokens.active, section.tau_p)
        threshold = prepass.get(STAPO_THRESHOLD_KEY)
        if threshold is None:  # exact only when this call sees the whole mini-batch
            threshold = stapo_entropy_threshold(tokens.entropy, cand, section.entropy_quantile)
        spurious = stapo_spurious_mask(cand, tokens.entropy, threshold)
        tokens.masks["stapo/spurious"] = spurious
        tokens.active = tokens.active & ~spurious
        tokens.counted = tokens.counted & ~spurious
        tokens.metrics["loss/stapo/masked_frac"] = pair(spurious.sum(), tokens.num_valid)

    def config_warnings(self, section: STAPOConfig, algorithm) -> Iterator[tuple[str, str]]:
        if algorithm.kl_coef > 0.0:
            yield "kl_coef", f"{algorithm.kl_coef} with STAPO enabled; the STAPO paper uses no KL term"
