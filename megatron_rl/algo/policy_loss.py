"""Per-token policy loss (PPO-clip, KL, entropy), token weights, and aggregation.

One source of truth for the loss math: the fused vocab-parallel op (``megatron_rl.ops``)
computes per-token ``logp`` and entropy, calls :func:`compute_policy_loss` on those
``[T]`` tensors with autograd, and chains the gradients into the logits.

Per valid token (``r = exp(logp - old_logp)``, ``w`` the TR-GRPO weight or 1):

    pg  = max(-A * w r, -A * clip(w r, 1 - eps_low, 1 + eps_high))
    pg  = min(pg, -A * c)                      if A < 0 and dual-clip is on
    l   = pg + kl_coef * w * kl(logp, ref)     - entropy_coef * H      (placement "ratio")
    l   = w * (pg + kl_coef * kl(logp, ref))   - entropy_coef * H      (placement "loss")

Departures from the papers (see docs/algorithms.md): the log-ratio is clamped to
[-20, 20] before ``exp`` so an extreme token cannot turn the loss into inf/NaN (only
tokens whose ratio is already far outside the clip range are affected).

Aggregation contract: every call returns ``(loss_sum, count, metrics)``. The caller sums
``loss_sum`` and ``count`` over micro-batches and data-parallel ranks and divides once,
so the result does not depend on the batch layout (except ``reference_microbatch_mean``,
which reproduces the AR/Lopti reference code's per-micro-batch mean on purpose). Each
mode is linear in the per-token loss: ``loss_sum = sum_t coef_t * l_t``.

    token_mean               coef = 1                count = valid tokens
    seq_mean_token_mean      coef = 1 / n_i          count = sequences
    seq_mean_token_sum_norm  coef = 1                count = sequences * constant_normalizer
    reference_microbatch_mean coef = 1 / n_microbatch count = 1 per micro-batch

Metrics are ``{name: tensor([sum, count], float64)}`` so they too reduce by summing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from megatron_rl.algo.config import AlgorithmConfig
from megatron_rl.algo.methods.base import pair
from megatron_rl.algo.methods.compose import (
    check_phase,
    old_logp_before_forward,
    reweight_advantages,
    select_tokens,
    token_weights,
)

LOG_RATIO_CLAMP = 20.0


@dataclass
class LossOutput:
    """What every loss returns: the aggregation triple, and the token selection it applied.

    The last four fields let diagnostics and tests read which tokens a call trained on and
    with which advantage, instead of re-deriving the methods' masks; all are detached and
    shaped like the call's per-token inputs ``[*S]``.
    """

    loss_sum: torch.Tensor
    """0-dim, differentiable, ``sum_t coef_t * l_t`` over this call's tokens."""
    count: torch.Tensor
    """0-dim float64, this call's share of the global normaliser."""
    metrics: dict[str, torch.Tensor]
    """``{name: tensor([sum, count], float64)}``, detached (denominators: docs/algorithms.md)."""
    active: torch.Tensor | None = None
    """bool ``[*S]``: tokens whose loss entered ``loss_sum`` (valid, in the call's phase,
    not silenced by STAPO)."""
    counted: torch.Tensor | None = None
    """bool ``[*S]``: tokens counted by the normaliser (``active``, or all valid tokens of
    both Lopti phases with ``lopti.denominator: all``)."""
    masks: dict[str, torch.Tensor] = field(default_factory=dict)
    """bool ``[*S]`` per method selection applied, by name: ``lopti/phase`` (the tokens of
    this call's Lopti phase), ``stapo/spurious`` (the tokens STAPO silenced)."""
    advantages: torch.Tensor | None = None
    """``[*S]`` effective advantages in the loss's dtype: the advantages the clipped
    objective used (reweighting applied by the caller) on ``active`` tokens, 0 elsewhere."""


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL(current || ref) estimate; gradient flows through ``logp`` only.

    ``k1 = logp - ref``; ``k2 = (logp - ref)^2 / 2``; ``k3 = exp(k) - k - 1`` with
    ``k = clamp(ref - logp, -5, 5)`` and the result clamped to ``[-10, 10]``.
    """
    ref = ref_logp.detach()
    if estimator == "k1":
        return logp - ref
    if estimator == "k2":
        return 0.5 * (logp - ref) ** 2
    if estimator == "k3":
        k = torch.clamp(ref - logp, min=-5.0, max=5.0)
        return torch.clamp(torch.exp(k) - k - 1.0, min=-10.0, max=10.0)
    raise ValueError(f"unknown kl_estimator {estimator!r}; allowed: 'k1', 'k2', 'k3'")


def ppo_clip_loss(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
    dual_clip_c: float | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token clipped surrogate ``max(-A r, -A clip(r))``, dual-clipped at ``-A c`` for ``A < 0``.

    Returns:
        ``(loss [*S], flags)`` with bool ``[*S]`` flags ``clip_low`` (A<0, r<1-eps_low),
        ``clip_high`` (A>0, r>1+eps_high) and ``clip_dual`` (A<0, surrogate capped at -A c).
    """
    l1 = -advantages * ratio
    l2 = -advantages * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(l1, l2)
    negative = advantages < 0
    flags = {
        "clip_low": negative & (ratio < 1.0 - eps_low),
        "clip_high": (advantages > 0) & (ratio > 1.0 + eps_high),
    }
    if dual_clip_c is not None:
        cap = -advantages * dual_clip_c
        flags["clip_dual"] = negative & (loss > cap)
        loss = torch.where(negative, torch.minimum(loss, cap), loss)
    else:
        flags["clip_dual"] = torch.zeros_like(negative)
    return loss, flags


def prepare_advantages(
    advantages: torch.Tensor, old_logp: torch.Tensor | None, mask: torch.Tensor, config: AlgorithmConfig
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Once per RL step, before any update: every enabled method's advantage reweighting
    (Advantage Reweighting), in composition order.

    Args:
        advantages: ``[*S]`` token advantages (response advantage broadcast to its tokens).
        old_logp: ``[*S]`` old-policy log-probs at the rollout temperature; ``None`` when
            the update takes them from its own forward (allowed only when no enabled
            method reads them before the forward: ``old_logp_before_forward``).
        mask: ``[*S]`` valid response tokens.

    Returns:
        ``(advantages [*S], metrics)``; unchanged advantages when no method reweights.
    """
    if old_logp is None:
        if old_logp_before_forward(config):
            raise ValueError("an enabled method reweights the advantages from old_logp, which is None")
        return advantages, {}
    return reweight_advantages(config, advantages, old_logp, mask.bool())


def compute_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: AlgorithmConfig,
    *,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    phase: str | None = None,
    prepass: Mapping[str, torch.Tensor] | None = None,
    seq_index: torch.Tensor | None = None,
) -> LossOutput:
    """Token-weighted policy loss of one micro-batch, as a sum plus its normaliser share.

    Args:
        logp: ``[*S]`` current-policy log-probs of the target tokens (differentiable).
        old_logp: ``[*S]`` old-policy log-probs (constant).
        advantages: ``[*S]`` token advantages, reweighting already applied (:func:`prepare_advantages`).
        mask: ``[*S]`` valid response tokens (bool or 0/1). Values at invalid positions
            are never used, so padding may hold anything, NaN included.
        config: the ``algorithm`` config.
        ref_logp: ``[*S]`` reference log-probs; required when ``kl_coef > 0``.
        entropy: ``[*S]`` current full-distribution entropy; required by STAPO and the
            entropy bonus (differentiable for the bonus).
        phase: the update phase this call belongs to (``methods.update_phases``: Lopti's
            ``"low"``/``"high"``); only that phase's tokens contribute (PG, KL and entropy
            all masked to them); ``None`` when no enabled method has phases.
        prepass: mini-batch statistics from ``methods.prepass_statistics`` (STAPO's
            entropy threshold over the whole mini-batch and the DP group); ``None``
            computes them from this call's tokens, exact only when the call sees the
            whole mini-batch.
        seq_index: ``[*S]`` integer sequence id per token (packed layouts); ``None`` treats
            each row of the last dimension as one sequence. Only the seq-mean modes use it.

    Returns:
        :class:`LossOutput`; divide the global sum of ``loss_sum`` by the global sum of
        ``count`` (over micro-batches and the data-parallel group).
    """
    if logp.shape != old_logp.shape or logp.shape != advantages.shape or logp.shape != mask.shape:
        raise ValueError(
            "logp, old_logp, advantages and mask must share one shape; got "
            f"{tuple(logp.shape)}, {tuple(old_logp.shape)}, {tuple(advantages.shape)}, {tuple(mask.shape)}"
        )
    check_phase(config, phase)
    # Sanitised inputs, and which tokens contribute to the numerator (``active``) and to the
    # denominator (``counted``) after every method's selection (Lopti phase, STAPO mask).
    tokens = select_tokens(
        logp, old_logp, advantages, mask, config, phase=phase, entropy=entropy, prepass=prepass
    )  # fmt: skip
    valid, active, counted, metrics = tokens.valid, tokens.active, tokens.counted, tokens.metrics
    logp_v, old_v, adv_v, entropy_v = tokens.logp, tokens.old_logp, tokens.advantages, tokens.entropy
    zeros = torch.zeros_like(logp)

    # Stop-gradient token weights, by where they apply (TR-GRPO).
    ratio_w = loss_w = None
    weight_metrics = []
    for tw in token_weights(tokens, config):
        weight_metrics.append((tw.metric, tw.weight))
        if tw.placement == "ratio":
            ratio_w = tw.weight if ratio_w is None else ratio_w * tw.weight
        else:
            loss_w = tw.weight if loss_w is None else loss_w * tw.weight

    log_ratio = torch.clamp(logp_v - old_v, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    pg, flags = ppo_clip_loss(
        ratio if ratio_w is None else ratio_w * ratio,
        adv_v,
        eps_low=config.eps_low,
        eps_high=config.eps_high,
        dual_clip_c=config.dual_clip_c,
    )
    per_token = pg
    if config.kl_coef > 0.0:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs the reference log-probs: pass ref_logp=")
        ref_v = torch.where(valid, ref_logp.detach().to(logp.dtype), zeros)
        kl = kl_penalty(logp_v, ref_v, config.kl_estimator)
        per_token = per_token + config.kl_coef * (kl if ratio_w is None else ratio_w * kl)
        metrics["loss/ref_kl"] = _masked_pair(kl, active)
    if loss_w is not None:
        per_token = loss_w * per_token
    if config.entropy_coef > 0.0:
        if entropy_v is None:
            raise ValueError("entropy_coef > 0 needs the current-policy entropy: pass entropy=")
        per_token = per_token - config.entropy_coef * entropy_v

    coef, count = _aggregation(counted, valid, config, seq_index)
    loss_sum = torch.where(active, coef.to(per_token.dtype) * per_token, zeros).sum()

    n_active = active.sum().to(torch.float64)
    metrics["loss/pg_loss"] = _masked_pair(pg, active)
    for name in ("clip_low", "clip_high", "clip_dual"):
        metrics[f"loss/clip_frac/{name[5:]}"] = pair((flags[name] & active).sum(), n_active)
    # k3 estimate of KL(old || current) on the tokens being trained: r - 1 - log r >= 0.
    metrics["loss/approx_kl"] = _masked_pair(ratio - 1.0 - log_ratio, active)
    for name, weight in weight_metrics:
        metrics[name] = _masked_pair(weight, active)
    metrics["loss/active_tokens"] = pair(n_active, 1.0)
    return LossOutput(
        loss_sum=loss_sum,
        count=count,
        metrics=metrics,
        active=active,
        counted=counted,
        masks=dict(tokens.masks),
        advantages=torch.where(active, adv_v, zeros).detach(),
    )


def _aggregation(
    counted: torch.Tensor, valid: torch.Tensor, config: AlgorithmConfig, seq_index: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token coefficients ``[*S]`` and this call's normaliser share (see module docstring)."""
    mode = config.aggregation
    ones = torch.ones(counted.shape, dtype=torch.float64, device=counted.device)
    if mode == "token_mean":
        return ones, counted.sum().to(torch.float64)
    if mode == "reference_microbatch_mean":
        n = counted.sum().to(torch.float64).clamp(min=1.0)
        return ones / n, torch.ones((), dtype=torch.float64, device=counted.device)
    seq, num_seqs = _sequence_ids(counted, seq_index)
    if mode == "seq_mean_token_mean":
        # No boolean-mask indexing here or below: on a GPU each would sync with the host.
        per_seq = torch.zeros(num_seqs, dtype=torch.float64, device=counted.device)
        per_seq.index_add_(0, seq.reshape(-1), counted.reshape(-1).to(torch.float64))
        coef = torch.where(counted, 1.0 / per_seq[seq].clamp(min=1.0), torch.zeros_like(ones))
        # Tokens active but not counted cannot occur here: every active token is counted.
        return coef, (per_seq > 0).sum().to(torch.float64)
    if mode == "seq_mean_token_sum_norm":
        per_seq = torch.zeros(num_seqs, dtype=torch.float64, device=counted.device)
        per_seq.index_add_(0, seq.reshape(-1), valid.reshape(-1).to(torch.float64))
        return ones, (per_seq > 0).sum().to(torch.float64) * float(config.constant_normalizer)
    raise ValueError(f"unknown aggregation {mode!r}")


def _sequence_ids(mask: torch.Tensor, seq_index: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """Dense sequence id per token ``[*S]`` (int64) and the number of ids."""
    if seq_index is None:
        if mask.dim() == 0:
            raise ValueError("seq-mean aggregation needs [..., T] tensors or seq_index")
        rows = mask.numel() // mask.shape[-1] if mask.shape[-1] else 0
        ids = torch.arange(rows, device=mask.device).repeat_interleave(mask.shape[-1]).reshape(mask.shape)
        return ids, rows
    if seq_index.shape != mask.shape:
        raise ValueError(f"seq_index shape {tuple(seq_index.shape)} != token shape {tuple(mask.shape)}")
    uniq, inverse = torch.unique(seq_index, return_inverse=True)
    return inverse.reshape(mask.shape), int(uniq.numel())


def _masked_pair(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    values = values.detach().to(torch.float64)
    return pair(torch.where(mask, values, torch.zeros_like(values)).sum(), mask.sum())


def merge_metrics(parts: Iterable[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Sum ``{name: [sum, count]}`` metric dicts (micro-batches; then all-reduce over DP)."""
    out: dict[str, torch.Tensor] = {}
    for part in parts:
        for name, value in part.items():
            out[name] = out[name] + value if name in out else value.clone()
    return out


def finalize_metrics(merged: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """``sum / count`` per metric; metrics with no tokens are left out rather than reported as 0.

    ``loss/active_tokens`` keeps its raw sum (a count, not a mean).
    """
    out: dict[str, float] = {}
    for name, value in merged.items():
        if name == "loss/active_tokens":
            out[name] = float(value[0])
        elif float(value[1]) > 0:
            out[name] = float(value[0] / value[1])
    return out


__all__ = [
    "LossOutput",
    "compute_policy_loss",
    "finalize_metrics",
    "kl_penalty",
    "merge_metrics",
    "ppo_clip_loss",
    "prepare_advantages",
]
