"""Token-probability diagnostics: where the gradient comes from, grouped by ``p_old``.

The gradient of a token's loss w.r.t. its logits is bounded by terms proportional to
``1 - p``, so low-probability tokens pull hardest (methods.md). The AR/Lopti paper's
Figure 1 splits a step's response tokens into the four QUARTILES of their old
probability (four equal-count groups by rank) and shows each quartile's share of the
gradient norm and how far its probabilities move after the update. We log that every
step, and the same statistics for four FIXED probability ranges (whose counts say how
the distribution itself moves):

    tokens/quartile_q{k}/...      k = 1..4: the k-th quarter of the step's valid tokens
                                  sorted by p_old (q1 = lowest); sizes differ by at most 1
    tokens/bucket_p000_025/...    p_old in [0, 0.25)     (likewise p025_050, p050_075,
    tokens/bucket_p075_100/...    p_old in [0.75, 1]      lower edges inclusive)

with, for each group:

    count         valid tokens in the group
    mean_p        their mean p_old
    grad_share    their share of sum_t ||dL/dlogits_t|| over all valid tokens
    dp_mean       their mean probability change p_new - p_old after the step's update

and ``tokens/quartile_q{k}/p_max`` (the quartile's largest p_old: the quartile edges),
``tokens/count`` and ``tokens/logit_grad_norm_sum`` (the shares' denominator).

Every group is logged every step. A group with no tokens reports ``count = 0`` and 0
for each of its means (``mean_p``, ``dp_mean``, ``p_max``): a placeholder, not a
measurement, so readers (``plots.py``) must look at ``count`` and draw a gap. Its
``grad_share`` of 0 is a true value. When no token has any gradient
(``tokens/logit_grad_norm_sum == 0``: every advantage of the step was 0) every share is
0, so the shares sum to 1 exactly on steps with a gradient and to 0 otherwise.

Ties: tokens with equal ``p_old`` may fall in two neighbouring quartiles (the split is by
rank, in a stable order), which keeps the groups equal-count as the paper's are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PROB_BUCKET_EDGES = (0.25, 0.5, 0.75)
"""Upper edges of the first three fixed buckets (the last is ``[0.75, 1]``)."""

NUM_QUARTILES = 4


@dataclass(frozen=True, kw_only=True)
class TokenGroup:
    """One group of the diagnostics: its metric prefix and its label in plots."""

    prefix: str
    """Metric key prefix, e.g. ``tokens/quartile_q1``."""
    label: str
    """Short legend label, e.g. ``q1 (lowest p)``."""


QUARTILE_GROUPS: tuple[TokenGroup, ...] = tuple(
    TokenGroup(prefix=f"tokens/quartile_q{k}", label=f"q{k}" + (" (lowest p)" if k == 1 else ""))
    for k in range(1, NUM_QUARTILES + 1)
)
"""The four equal-count quartiles of ``p_old``, lowest first."""


def _bucket_group(lo: float, hi: float) -> TokenGroup:
    return TokenGroup(
        prefix=f"tokens/bucket_p{round(lo * 100):03d}_{round(hi * 100):03d}",
        label=f"p in [{lo:.2f}, {hi:.2f}" + ("]" if hi == 1.0 else ")"),
    )


BUCKET_GROUPS: tuple[TokenGroup, ...] = tuple(
    _bucket_group(lo, hi) for lo, hi in zip((0.0, *PROB_BUCKET_EDGES), (*PROB_BUCKET_EDGES, 1.0))
)
"""The fixed probability ranges ``[0, .25) [.25, .5) [.5, .75) [.75, 1]``, lowest first."""

GRAD_NORM_SUM_KEY = "tokens/logit_grad_norm_sum"
"""The step's ``sum_t ||dL/dlogits_t||`` over valid tokens (0: no gradient, shares all 0)."""

COUNT_KEY = "tokens/count"
"""The step's valid response tokens."""


def quartile_index(p: torch.Tensor) -> torch.Tensor:
    """Quartile (0..3) of each value of the 1-D ``p`` by rank: ``floor(4 * rank / n)``.

    Group sizes are ``floor(n/4)`` or ``ceil(n/4)`` (equal within 1); the order is stable,
    so equal values keep their input order.
    """
    n = p.numel()
    order = torch.sort(p, stable=True).indices
    rank = torch.empty_like(order)
    rank[order] = torch.arange(n, device=p.device)
    return torch.div(rank * NUM_QUARTILES, max(n, 1), rounding_mode="floor")


def token_probability_diagnostics(
    old_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    logit_grad_norm: torch.Tensor | None = None,
    new_logp: torch.Tensor | None = None,
) -> dict[str, float]:
    """Per-quartile and per-bucket token counts, mean ``p_old``, gradient shares and ``dp``.

    Args:
        old_logp: ``[*S]`` old-policy log-probs of the sampled tokens.
        mask: ``[*S]`` valid response tokens.
        logit_grad_norm: ``[*S]`` per-token ``||dL/dlogits_t||`` (the fused op's
            ``SoftmaxStats.logit_grad_norm``); shares are left out when ``None``.
        new_logp: ``[*S]`` log-probs of the same tokens after the update; ``dp_mean`` is
            left out when ``None``.

    Returns:
        Flat ``{metric name: value}`` with every group present (module docstring: empty
        groups report count 0 and 0 means).
    """
    valid = mask.reshape(-1).bool()
    p_old = old_logp.detach().reshape(-1).double().exp()[valid]
    grad = logit_grad_norm.detach().reshape(-1).double()[valid] if logit_grad_norm is not None else None
    dp = new_logp.detach().reshape(-1).double().exp()[valid] - p_old if new_logp is not None else None
    total_grad = float(grad.sum()) if grad is not None else 0.0

    out: dict[str, float] = {COUNT_KEY: float(p_old.numel())}
    if grad is not None:
        out[GRAD_NORM_SUM_KEY] = total_grad
    quartile = quartile_index(p_old)
    bucket = torch.bucketize(p_old, torch.tensor(PROB_BUCKET_EDGES, dtype=torch.float64), right=True)
    for groups, index in ((QUARTILE_GROUPS, quartile), (BUCKET_GROUPS, bucket)):
        for k, group in enumerate(groups):
            sel = index == k
            n = int(sel.sum())
            out[f"{group.prefix}/count"] = float(n)
            out[f"{group.prefix}/mean_p"] = float(p_old[sel].mean()) if n else 0.0
            if grad is not None:
                out[f"{group.prefix}/grad_share"] = float(grad[sel].sum()) / total_grad if total_grad > 0 else 0.0
            if dp is not None:
                out[f"{group.prefix}/dp_mean"] = float(dp[sel].mean()) if n else 0.0
            if groups is QUARTILE_GROUPS:
                out[f"{group.prefix}/p_max"] = float(p_old[sel].max()) if n else 0.0
    return out
