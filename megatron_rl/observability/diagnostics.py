"""Token-probability diagnostics: where the gradient comes from, bucketed by ``p_old``.

The gradient of a token's loss w.r.t. its logits is bounded by terms proportional to
``1 - p``, so low-probability tokens pull hardest (methods.md). The AR/Lopti paper's key
figure buckets tokens by probability and shows each bucket's share of the gradient and
how much its probabilities move after an update; we log the same every step:

    tokens/prob_q{k}/count        valid tokens whose p_old falls in bucket k
    tokens/prob_q{k}/mean_p       their mean p_old
    tokens/prob_q{k}/grad_share   their share of sum_t ||dL/dlogits_t|| over all valid tokens
    tokens/prob_q{k}/dp_mean      their mean probability change p_new - p_old after the update

Buckets are the quartiles of the probability RANGE, ``[0, .25) [.25, .5) [.5, .75) [.75, 1]``
(``q1`` lowest), not of the data: data quartiles would hold a quarter of the tokens each
by construction, so their counts would carry no information.
"""

from __future__ import annotations

import torch

PROB_BUCKET_EDGES = (0.25, 0.5, 0.75)
"""Upper edges of buckets q1..q3 (q4 is ``[0.75, 1]``)."""


def token_probability_diagnostics(
    old_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    logit_grad_norm: torch.Tensor | None = None,
    new_logp: torch.Tensor | None = None,
) -> dict[str, float]:
    """Per-bucket token counts, mean ``p_old``, gradient-norm shares and probability changes.

    Args:
        old_logp: ``[*S]`` old-policy log-probs of the sampled tokens.
        mask: ``[*S]`` valid response tokens.
        logit_grad_norm: ``[*S]`` per-token ``||dL/dlogits_t||`` (the fused op's
            ``SoftmaxStats.logit_grad_norm``); shares are left out when ``None``.
        new_logp: ``[*S]`` log-probs of the same tokens after the update; ``dp_mean`` is
            left out when ``None``.

    Returns:
        Flat ``{metric name: value}``; empty buckets report a count of 0 and no means.
    """
    valid = mask.reshape(-1).bool()
    p_old = old_logp.detach().reshape(-1).double().exp()[valid]
    bucket = torch.bucketize(p_old, torch.tensor(PROB_BUCKET_EDGES, dtype=torch.float64), right=True)
    grad = logit_grad_norm.detach().reshape(-1).double()[valid] if logit_grad_norm is not None else None
    total_grad = float(grad.sum()) if grad is not None else 0.0
    dp = new_logp.detach().reshape(-1).double().exp()[valid] - p_old if new_logp is not None else None
    out: dict[str, float] = {}
    for k in range(len(PROB_BUCKET_EDGES) + 1):
        sel = bucket == k
        n = int(sel.sum())
        prefix = f"tokens/prob_q{k + 1}"
        out[f"{prefix}/count"] = float(n)
        if n == 0:
            continue
        out[f"{prefix}/mean_p"] = float(p_old[sel].mean())
        if grad is not None and total_grad > 0:
            out[f"{prefix}/grad_share"] = float(grad[sel].sum()) / total_grad
        if dp is not None:
            out[f"{prefix}/dp_mean"] = float(dp[sel].mean())
    return out
