"""Typed configs of the loss library (the ``algorithm`` section of a run config).

Defaults follow the AR/Lopti paper's K&K runs (``docs/algorithms.md`` lists them and
every place we depart from a paper). Each method is off unless enabled, so the default
``AlgorithmConfig()`` is plain GRPO with clip-higher and dual-clip.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_rl.configlib import ConfigError, check_literals, require_range

AggregationMode = Literal[
    "token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "reference_microbatch_mean"
]


@dataclass(kw_only=True)
class AdvantageConfig:
    """How per-response rewards become advantages."""

    estimator: str = "grpo"
    """Registered advantage estimator (``grpo``, ``dr_grpo``, ``rloo``, ``reinforce_pp`` or a
    user-registered name); checked against the registry when the run starts."""

    eps: float = 1e-6
    """Added to the standard deviation before dividing (``grpo``, ``reinforce_pp``)."""

    single_sample_group: Literal["zero", "raw_reward"] = "zero"
    """Advantage of a response that is alone in its group: ``zero`` (no baseline, so no
    signal) or ``raw_reward`` (the reference code's mean 0 / std 1, i.e. R / (1 + eps))."""

    def __post_init__(self) -> None:
        check_literals(self)
        if not self.estimator:
            raise ConfigError("estimator", "must be a non-empty estimator name")
        require_range("eps", self.eps, ge=0.0)


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
        import math

        sig = 1.0 / (1.0 + math.exp(-1.0 / self.tau))
        return 1.0 / (sig - self.mu) if sig != self.mu else float("inf")


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


@dataclass(kw_only=True)
class AlgorithmConfig:
    """The ``algorithm`` section: advantages, the per-token policy loss and its aggregation.

    Per token: PPO-clip with clip-higher and dual-clip, plus ``kl_coef * KL(ref)`` and
    ``- entropy_coef * H``. Token weights (AR, Lopti, TR-GRPO, STAPO) compose.
    """

    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    """How rewards become advantages."""

    eps_low: float = 0.2
    """Lower clip: the ratio is clipped below at ``1 - eps_low``."""

    eps_high: float = 0.24
    """Upper clip (clip-higher): the ratio is clipped above at ``1 + eps_high``."""

    dual_clip_c: float | None = 10.0
    """Dual-clip constant ``c`` (> 1): for ``A < 0`` the loss is capped at ``-A * c``; ``None`` disables."""

    kl_coef: float = 0.0
    """Coefficient of the KL-to-reference term; 0 disables it (and the reference forward).
    The AR/Lopti papers use 0.001 with ``k3``."""

    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """``k1 = logp - ref``, ``k2 = (logp - ref)^2 / 2``, ``k3 = exp(k) - k - 1`` with
    ``k = clamp(ref - logp, -5, 5)`` and the result clamped to [-10, 10]."""

    entropy_coef: float = 0.0
    """Entropy bonus coefficient: ``- entropy_coef * H`` is added per token (0 in the papers)."""

    aggregation: AggregationMode = "token_mean"
    """``token_mean``: sum over valid tokens / GLOBAL valid-token count (default; invariant to
    micro-batch, DP and TP/PP layout). ``seq_mean_token_mean``: per-sequence token mean, then
    mean over sequences. ``seq_mean_token_sum_norm``: Dr.GRPO, per-sequence token SUM divided by
    ``constant_normalizer``, then mean over sequences. ``reference_microbatch_mean``: the AR/Lopti
    reference code's per-micro-batch token mean (depends on the micro-batch size; for replication)."""

    constant_normalizer: int | None = None
    """Dr.GRPO's constant (tokens per sequence, usually the max response length); required by
    ``seq_mean_token_sum_norm``."""

    ar: ARConfig = field(default_factory=ARConfig)
    """Advantage Reweighting."""

    lopti: LoptiConfig = field(default_factory=LoptiConfig)
    """Low-Probability Token Isolation."""

    tr_grpo: TRGRPOConfig = field(default_factory=TRGRPOConfig)
    """TR-GRPO probability-increasing token weights."""

    stapo: STAPOConfig = field(default_factory=STAPOConfig)
    """STAPO spurious-token mask."""

    def __post_init__(self) -> None:
        check_literals(self)
        require_range("eps_low", self.eps_low, ge=0.0, lt=1.0)
        require_range("eps_high", self.eps_high, ge=0.0)
        require_range("dual_clip_c", self.dual_clip_c, gt=1.0)
        require_range("kl_coef", self.kl_coef, ge=0.0)
        require_range("entropy_coef", self.entropy_coef, ge=0.0)
        if self.aggregation == "seq_mean_token_sum_norm":
            if self.constant_normalizer is None:
                raise ConfigError(
                    "constant_normalizer",
                    "got None; aggregation 'seq_mean_token_sum_norm' needs a positive token count",
                )
        require_range("constant_normalizer", self.constant_normalizer, gt=0)

    @property
    def needs_entropy(self) -> bool:
        """Whether the loss needs the full-distribution entropy of the current policy."""
        return self.entropy_coef > 0.0 or self.stapo.enabled

    @property
    def needs_ref_logp(self) -> bool:
        """Whether the loss needs reference-policy log-probs."""
        return self.kl_coef > 0.0
