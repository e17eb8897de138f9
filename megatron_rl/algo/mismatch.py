"""Engine/actor log-prob mismatch metrics and truncated importance sampling (TIS) weights.

Rollout engines and the trainer compute the same log-probs with different kernels (vLLM's
fused attention and bf16 sampler vs Megatron's training forward), so the policy that
*sampled* a token (``engine_logp``) differs slightly from the policy the PPO ratio uses
as "old" (``actor_logp``, recomputed by the actor). Both are ``log_softmax(logits / T)``
over the full vocabulary at the rollout temperature (``base.py``), so the difference is
numerical mismatch only. Logged every step:

    rollout/logp_mismatch/mean_abs   mean over valid tokens of |actor_logp - engine_logp|
    rollout/logp_mismatch/max_abs    max of the same
    rollout/logp_mismatch/mean       mean signed difference (actor - engine)
    rollout/logp_mismatch/ratio_mean mean of exp(actor_logp - engine_logp)
    rollout/logp_mismatch/num_tokens valid tokens

Truncated importance sampling (Yao et al., "Your efficient RL framework secretly brings
you off-policy RL training", 2025): the samples come from the engine policy, so an
unbiased policy gradient for the actor's old policy weights each token by
``p_actor_old / p_engine``; truncating at ``cap`` bounds the variance:

    w_t = min(exp(actor_old_logp_t - engine_logp_t), cap)      (no gradient)

How the trainer uses it: multiply the per-token advantages by ``w`` once per step,
before any update (as AR weights are applied), so the PPO-clip surrogate becomes
``min(r * w * A, clip(r) * w * A)`` -- the TIS-corrected objective. ``w`` is 1 on padded
tokens, so masks stay the only thing that removes tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MismatchOutput", "logprob_mismatch", "truncated_is_weights"]

# exp() of a log-ratio beyond this overflows float32 and carries no information once
# clipped at any sensible cap.
_LOG_RATIO_CLAMP = 20.0


@dataclass
class MismatchOutput:
    """Result of :func:`logprob_mismatch`."""

    metrics: dict[str, float]
    """Scalar metrics over the valid tokens (see the module docstring for the keys)."""

    tis_weights: torch.Tensor | None
    """``[*S]`` float32 TIS weights (1 on invalid tokens), or None when ``tis_cap`` is None."""


@torch.no_grad()
def logprob_mismatch(
    engine_logp: torch.Tensor,
    actor_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    tis_cap: float | None = None,
) -> MismatchOutput:
    """Mismatch metrics between engine and actor log-probs, and optional TIS weights.

    Call once per step on the step's whole batch (``max_abs`` does not sum across calls).

    Args:
        engine_logp: ``[*S]`` log-probs the rollout engine reported for the sampled tokens.
        actor_logp: ``[*S]`` the actor's recomputed old-policy log-probs of the same tokens,
            at the same temperature.
        mask: ``[*S]`` valid response tokens (bool or 0/1).
        tis_cap: truncation ``cap >= 1`` of the importance weights (``rollout.tis_cap``);
            None skips the weights.

    Returns:
        :class:`MismatchOutput`. With no valid token the means are 0 and ``num_tokens`` 0.
        TIS metrics (when ``tis_cap`` is set): ``rollout/tis/weight_mean`` and
        ``rollout/tis/clip_frac`` (fraction of valid tokens whose ratio exceeded the cap).
    """
    if engine_logp.shape != actor_logp.shape or engine_logp.shape != mask.shape:
        raise ValueError(
            f"shapes differ: engine_logp {tuple(engine_logp.shape)}, actor_logp {tuple(actor_logp.shape)}, "
            f"mask {tuple(mask.shape)}"
        )
    if tis_cap is not None and not tis_cap >= 1.0:
        raise ValueError(f"tis_cap: got {tis_cap}; must be >= 1 (or None to disable TIS)")
    valid = mask.bool()
    # float64 for the reductions: a step has up to millions of tokens.
    diff = _log_ratio(actor_logp, engine_logp)
    diff_valid = diff[valid]
    count = int(diff_valid.numel())
    ratio_valid = diff_valid.exp()
    metrics = {
        "rollout/logp_mismatch/mean_abs": float(diff_valid.abs().mean()) if count else 0.0,
        "rollout/logp_mismatch/max_abs": float(diff_valid.abs().max()) if count else 0.0,
        "rollout/logp_mismatch/mean": float(diff_valid.mean()) if count else 0.0,
        "rollout/logp_mismatch/ratio_mean": float(ratio_valid.mean()) if count else 0.0,
        "rollout/logp_mismatch/num_tokens": float(count),
    }
    weights = None
    if tis_cap is not None:
        weights = _weights(diff, valid, tis_cap)
        metrics["rollout/tis/weight_mean"] = float(weights[valid].double().mean()) if count else 0.0
        metrics["rollout/tis/clip_frac"] = float((ratio_valid > tis_cap).double().mean()) if count else 0.0
    return MismatchOutput(metrics=metrics, tis_weights=weights)


@torch.no_grad()
def truncated_is_weights(
    actor_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor, tis_cap: float
) -> torch.Tensor:
    """``[*S]`` float32 TIS weights ``min(exp(actor_logp - engine_logp), tis_cap)`` on the
    valid tokens of ``mask``, 1 elsewhere (no gradient).

    The one formula of the weights: :func:`logprob_mismatch` applies it to recomputed old
    log-probs before the update, and the fused loss to the train forward's own (detached)
    log-probs when an on-policy optimizer step takes its old log-probs from that forward.
    """
    return _weights(_log_ratio(actor_logp, engine_logp), mask.bool(), tis_cap)


def _log_ratio(actor_logp: torch.Tensor, engine_logp: torch.Tensor) -> torch.Tensor:
    """``actor_logp - engine_logp`` in float64, clamped to what ``exp`` carries."""
    return (actor_logp.double() - engine_logp.double()).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)


def _weights(log_ratio: torch.Tensor, valid: torch.Tensor, tis_cap: float) -> torch.Tensor:
    ratio = log_ratio.exp()
    return torch.where(valid, ratio.clamp(max=tis_cap), torch.ones_like(ratio)).to(torch.float32)
