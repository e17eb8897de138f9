"""The ``algorithm`` section of a run config: advantages, the policy loss, and one
sub-section per token-weight method (each declared in its method's file, ``methods/``).

Defaults follow the AR/Lopti paper's K&K runs (``docs/algorithms.md`` lists them and
every place we depart from a paper). Each method is off unless enabled, so the default
``AlgorithmConfig()`` is plain GRPO with clip-higher and dual-clip. The methods compose
in the order this module imports them (their registration order).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_rl.algo.methods.ar import ARConfig
from megatron_rl.algo.methods.base import TOKEN_WEIGHT_METHODS
from megatron_rl.algo.methods.lopti import LoptiConfig
from megatron_rl.algo.methods.stapo import STAPOConfig
from megatron_rl.algo.methods.tr_grpo import TRGRPOConfig
from megatron_rl.config.lib import ConfigError, check_literals, require_range

__all__ = ["AdvantageConfig", "AggregationMode", "AlgorithmConfig"]

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
        sections = ((m, getattr(self, name, self)) for name, m in TOKEN_WEIGHT_METHODS.items())
        return self.entropy_coef > 0.0 or any(m.enabled(s) and m.needs_entropy(s) for m, s in sections)

    @property
    def needs_ref_logp(self) -> bool:
        """Whether the loss needs reference-policy log-probs."""
        return self.kl_coef > 0.0
