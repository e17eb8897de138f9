"""Token weights and masks that stop low-probability tokens from dominating the gradient.

The gradient of a token's loss w.r.t. the logits scales with ``(1 - p)``, so rare tokens
pull hardest. The four methods here counter that; all are stop-gradient and compose:

- Advantage Reweighting (AR, arXiv 2505.12929): ``A <- (alpha * p_old + 1 - alpha) * A``,
  with ``p_old`` the OLD (rollout) policy probability at the rollout temperature. Applied
  once per RL step, before any update (``advantage_reweight``).
- Lopti (same paper): tokens split by ``p_old < eta`` (strict) into a low and a high set;
  two update passes, low FIRST (``lopti_split``; the pass masks live in ``policy_loss``).
- TR-GRPO (arXiv 2511.00066): ``w = clip(alpha * (sigmoid(p / tau) - mu), L, U)`` of the
  CURRENT probability (``tr_grpo_weight``).
- STAPO (arXiv 2602.15620): drop tokens with ``A > 0``, ``p < tau_p`` and ``H < tau_h``,
  ``tau_h`` a quantile of entropy over those candidates in the mini-batch
  (``stapo_candidates``, ``stapo_entropy_threshold``, ``stapo_spurious_mask``).

Shapes: every per-token tensor has the same arbitrary shape ``[*S]`` (``[N, T]`` padded
or ``[T]`` packed); masks are bool or 0/1.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_rl.algo.config import TRGRPOConfig


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
    before the micro-batch loop: within one optimizer step the weights do not change, so
    the entropies of a forward-only pre-pass equal those inside the loss.

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
