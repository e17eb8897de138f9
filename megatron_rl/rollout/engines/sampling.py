"""Token sampling from logits with one uniform number per row: temperature, top-k, top-p.

Pure tensor functions shared by the HF engine and the tests. Sampling is inverse-CDF:
row ``r`` draws the token at which the cumulative (truncated) probability first exceeds
``u_r * total``. One pre-drawn uniform per row and step, from a per-sample generator
(:func:`sample_uniforms`), makes a sample's tokens independent of which other samples
share its batch; Gumbel-max would need ``V`` random numbers per row and step.

Truncation follows vLLM's order (top-k first, then top-p on the renormalised top-k
distribution): a token is kept by top-p when the mass of the strictly more likely
tokens is ``< top_p``, so the most likely token is always kept. Ties at the k-th logit
are broken by ``torch.topk`` (exactly k tokens are kept).

The reported log-prob is always ``log_softmax(logits / T)`` of the sampled token over the
full vocabulary (see ``base.py`` for why).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_rl.config.seeding import derive_seed
from megatron_rl.rollout.generation import SamplingParams

__all__ = ["row_seeds", "sample_next", "sample_uniforms", "truncated_probs"]


def sample_uniforms(seeds: Sequence[int], num_steps: int) -> torch.Tensor:
    """``[R, num_steps]`` float64 uniforms in [0, 1); row ``r`` comes from ``seeds[r]`` alone."""
    out = torch.empty(len(seeds), num_steps, dtype=torch.float64)
    for r, seed in enumerate(seeds):
        gen = torch.Generator().manual_seed(seed)
        torch.rand(num_steps, generator=gen, dtype=torch.float64, out=out[r])
    return out


def row_seeds(prompt_seeds: Sequence[int], n: int) -> list[int]:
    """Seeds of the ``len(prompt_seeds) * n`` sample rows (prompt-major, sample-minor)."""
    return [derive_seed(seed, j) for seed in prompt_seeds for j in range(n)]


def truncated_probs(logp_RV: torch.Tensor, top_k: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Probabilities after top-k / top-p truncation (unnormalised is fine for sampling).

    Args:
        logp_RV: ``[R, V]`` log-probs at the sampling temperature.

    Returns:
        ``(probs [R, K], index [R, K] or None)``: when ``index`` is None the columns are the
        vocabulary itself (no truncation); otherwise column ``c`` holds token ``index[:, c]``,
        sorted by decreasing probability. Truncated entries have probability 0.
    """
    vocab = logp_RV.shape[-1]
    k = top_k if 0 < top_k < vocab else vocab
    if top_p >= 1.0 and k == vocab:
        return logp_RV.exp(), None
    if k < vocab:
        sorted_logp, index = torch.topk(logp_RV, k, dim=-1, sorted=True)
    else:
        sorted_logp, index = torch.sort(logp_RV, dim=-1, descending=True)
    probs = sorted_logp.exp()
    if top_p < 1.0:
        # Renormalise over the top-k survivors, then keep tokens whose strictly-more-likely
        # mass is below top_p (vLLM's rule, written from the descending side).
        norm = probs / probs.sum(dim=-1, keepdim=True)
        mass_before = torch.cumsum(norm, dim=-1) - norm
        probs = torch.where(mass_before < top_p, probs, torch.zeros_like(probs))
    return probs, index


def sample_next(
    logits_RV: torch.Tensor, uniforms_R: torch.Tensor, params: SamplingParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row and return its full-vocabulary log-prob at the temperature.

    Args:
        logits_RV: ``[R, V]`` next-token logits (any float dtype; computed in float32).
        uniforms_R: ``[R]`` float64 uniforms in [0, 1) (ignored for greedy decoding).
        params: temperature / top-k / top-p.

    Returns:
        ``(tokens [R] int64, logprobs [R] float32)`` where
        ``logprobs = log_softmax(logits / T)[tokens]`` (T = 1 for greedy).
    """
    logits = logits_RV.float()
    if params.greedy:
        tokens = logits.argmax(dim=-1)
        logp = torch.log_softmax(logits, dim=-1)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
    logp = torch.log_softmax(logits / params.temperature, dim=-1)
    probs, index = truncated_probs(logp, params.top_k, params.top_p)
    # float64 CDF: with a 150k vocabulary a float32 running sum drifts by ~1e-4.
    cdf = torch.cumsum(probs.double(), dim=-1)
    target = uniforms_R.to(cdf.device, torch.float64)[:, None] * cdf[:, -1:]
    col = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[-1] - 1)
    tokens = (col if index is None else index.gather(-1, col)).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
