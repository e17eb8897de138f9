"""Token-weight methods as registered objects, composed by the policy loss.

Each method of ``token_weights.py`` is one :class:`TokenWeightMethod` in
:data:`TOKEN_WEIGHT_METHODS`, registered in the order they compose. A method can:

- reweight the advantages once per RL step, before any update, from the old
  log-probs (:meth:`~TokenWeightMethod.reweight_advantages`: Advantage Reweighting);
- split each RL step's update into phases, run in order, each a full pass over the
  mini-batches with its own optimizer steps (:meth:`~TokenWeightMethod.phases`: Lopti's
  low-probability pass, then its high-probability pass);
- narrow, inside the loss, which tokens a call trains on (``active``) and which count in
  its normaliser (``counted``) (:meth:`~TokenWeightMethod.select`: Lopti's phase, STAPO's
  spurious tokens);
- need a statistic of the whole mini-batch from a forward-only pre-pass of the current
  policy before the loss runs (:meth:`~TokenWeightMethod.prepass_statistics`: STAPO's
  entropy threshold, a quantile over the mini-batch);
- weight each token's objective (:meth:`~TokenWeightMethod.token_weight`: TR-GRPO, inside
  the ratio or on the per-token loss).

The actor and the trainer only use the generic entry points below
(:func:`update_phases`, :func:`needs_prepass`, :func:`prepass_statistics`,
``policy_loss.prepare_advantages`` / ``compute_policy_loss``) and never name a method, so
a new method is one more registered object. At most one enabled method may define
phases (two would need an order between them that no paper specifies).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist

from megatron_rl.algo.config import AlgorithmConfig
from megatron_rl.algo.token_weights import (
    advantage_reweight,
    lopti_split,
    stapo_candidates,
    stapo_entropy_threshold,
    stapo_spurious_mask,
    tr_grpo_weight,
)
from megatron_rl.configlib import Registry


def pair(total: torch.Tensor | float, count: torch.Tensor | float) -> torch.Tensor:
    """A metric as ``tensor([sum, count], float64)`` (metrics reduce by summing these).

    On the device of whichever argument is a tensor (``total``'s first): a plain number or
    a CPU scalar beside a CUDA total must not make ``stack`` mix devices.
    """
    device = next((x.device for x in (total, count) if isinstance(x, torch.Tensor)), None)

    def f64(x: torch.Tensor | float) -> torch.Tensor:
        if isinstance(x, torch.Tensor):
            return x.detach().to(dtype=torch.float64, device=device)
        # A fill on the device: a Python number copied host-to-device would make the host
        # wait for the device (torch synchronises a pageable host-to-device copy).
        return torch.full((), float(x), dtype=torch.float64, device=device)

    return torch.stack([f64(total), f64(count)])


@dataclass
class TokenSelection:
    """The per-token state of one loss call that methods read and narrow; all ``[*S]``.

    Values at positions where ``valid`` is False are sanitised to 0 (padding may hold
    anything, NaN included, before that).
    """

    valid: torch.Tensor
    """bool: the call's valid response tokens."""
    logp: torch.Tensor
    """Current-policy log-probs (differentiable)."""
    old_logp: torch.Tensor
    """Old-policy log-probs (constant)."""
    advantages: torch.Tensor
    """Token advantages, reweighting already applied (constant)."""
    entropy: torch.Tensor | None = None
    """Current full-distribution entropy, when the caller has it."""
    active: torch.Tensor = None  # type: ignore[assignment]
    """bool: tokens whose loss enters the numerator (starts as ``valid``)."""
    counted: torch.Tensor = None  # type: ignore[assignment]
    """bool: tokens counted by the normaliser (starts as ``valid``)."""
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """Metrics as ``[sum, count]`` pairs, added to by the methods."""
    masks: dict[str, torch.Tensor] = field(default_factory=dict)
    """bool ``[*S]`` masks the methods applied, by name (``lopti/phase``, ``stapo/spurious``);
    returned on ``LossOutput.masks``."""

    def __post_init__(self) -> None:
        self.active = self.valid if self.active is None else self.active
        self.counted = self.valid if self.counted is None else self.counted

    @property
    def num_valid(self) -> torch.Tensor:
        """Valid tokens, float64 0-dim."""
        return self.valid.sum().to(torch.float64)


@dataclass(frozen=True)
class TokenWeight:
    """A stop-gradient per-token weight and where it applies."""

    weight: torch.Tensor
    """``[*S]`` weights."""
    placement: Literal["ratio", "loss"]
    """``ratio``: inside the clipped objective and on the KL term; ``loss``: multiplies the
    per-token loss (PG + KL)."""
    metric: str
    """Name of the metric reporting its mean over the active tokens."""


@dataclass(frozen=True)
class PrepassTokens:
    """One micro-batch of a forward-only pre-pass, all ``[*S]``."""

    logp: torch.Tensor
    entropy: torch.Tensor
    old_logp: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor


class TokenWeightMethod:
    """One token-weight method; every hook defaults to "does nothing"."""

    name: str = ""
    """Registry name; also the ``algorithm`` sub-section that configures it."""

    def enabled(self, config: AlgorithmConfig) -> bool:
        raise NotImplementedError

    def phases(self, config: AlgorithmConfig) -> tuple[str, ...]:
        """The update phases, in the order they run (empty: no phases)."""
        return ()

    def reweight_advantages(
        self, advantages: torch.Tensor, old_logp: torch.Tensor, valid: torch.Tensor, config: AlgorithmConfig
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Once per RL step, before any update."""
        return advantages, {}

    def reads_old_logp_before_forward(self, config: AlgorithmConfig) -> bool:
        """Whether the method reads the old log-probs before the train forward runs (so the
        first update cannot take them from that forward; see :func:`old_logp_before_forward`)."""
        return False

    def needs_prepass(self, config: AlgorithmConfig) -> bool:
        return False

    def prepass_statistics(
        self, config: AlgorithmConfig, phase: str | None, parts: Sequence[PrepassTokens], group
    ) -> dict[str, torch.Tensor]:
        """Statistics of the whole mini-batch (``parts`` over the ranks of ``group``)."""
        return {}

    def select(
        self, tokens: TokenSelection, config: AlgorithmConfig, phase: str | None, prepass: Mapping[str, torch.Tensor]
    ) -> None:
        """Narrow ``tokens.active`` / ``tokens.counted`` (in place) and add metrics."""

    def token_weight(self, tokens: TokenSelection, config: AlgorithmConfig) -> TokenWeight | None:
        return None


TOKEN_WEIGHT_METHODS: Registry[TokenWeightMethod] = Registry("token-weight method")
"""The methods, in the order they compose."""

STAPO_THRESHOLD_KEY = "stapo/entropy_threshold"
"""Pre-pass statistic: STAPO's ``tau_h`` over the whole mini-batch (0-dim float64)."""


def _register(cls: type[TokenWeightMethod]) -> type[TokenWeightMethod]:
    TOKEN_WEIGHT_METHODS.register(cls.name, cls())
    return cls


@_register
class AdvantageReweighting(TokenWeightMethod):
    """AR (arXiv 2505.12929): ``A <- (alpha * p_old + 1 - alpha) * A`` once per RL step."""

    name = "ar"

    def enabled(self, config: AlgorithmConfig) -> bool:
        return config.ar.enabled

    def reads_old_logp_before_forward(self, config: AlgorithmConfig) -> bool:
        return True  # the advantages are reweighted before the loss runs

    def reweight_advantages(self, advantages, old_logp, valid, config):
        adv, weight = advantage_reweight(advantages, old_logp, valid, config.ar.alpha)
        weight = weight.to(torch.float64)
        return adv, {"loss/ar/weight_mean": pair(torch.where(valid, weight, torch.zeros_like(weight)).sum(), valid.sum())}


@_register
class Lopti(TokenWeightMethod):
    """Lopti (arXiv 2505.12929): a low-probability pass first, then a high-probability pass."""

    name = "lopti"

    def enabled(self, config: AlgorithmConfig) -> bool:
        return config.lopti.enabled

    def phases(self, config: AlgorithmConfig) -> tuple[str, ...]:
        return ("low", "high")

    def select(self, tokens, config, phase, prepass):
        low, high = lopti_split(tokens.old_logp, tokens.valid, config.lopti.eta)
        part = low if phase == "low" else high
        tokens.active = tokens.active & part
        tokens.masks["lopti/phase"] = part
        if config.lopti.denominator == "phase":
            tokens.counted = tokens.counted & part
        tokens.metrics["loss/lopti/low_frac"] = pair(low.sum(), tokens.num_valid)


@_register
class STAPO(TokenWeightMethod):
    """STAPO (arXiv 2602.15620): silence spurious tokens (A > 0, p < tau_p, H < tau_h)."""

    name = "stapo"

    def enabled(self, config: AlgorithmConfig) -> bool:
        return config.stapo.enabled

    def needs_prepass(self, config: AlgorithmConfig) -> bool:
        # tau_h is a quantile over the whole mini-batch, which one micro-batch does not see.
        return True

    def prepass_statistics(self, config, phase, parts, group):
        entropies = []
        for part in parts:
            tokens = select_tokens(part.logp, part.old_logp, part.advantages, part.mask, config, phase=phase,
                                   entropy=part.entropy, before=self)  # fmt: skip
            candidates = stapo_candidates(tokens.advantages, tokens.logp, tokens.active, config.stapo.tau_p)
            entropies.append(part.entropy[candidates])
        flat = torch.cat(entropies)
        threshold = stapo_entropy_threshold(
            flat, torch.ones_like(flat, dtype=torch.bool), config.stapo.entropy_quantile, group=group
        )
        return {STAPO_THRESHOLD_KEY: threshold}

    def select(self, tokens, config, phase, prepass):
        if tokens.entropy is None:
            raise ValueError("STAPO needs the current-policy entropy: pass entropy=")
        cand = stapo_candidates(tokens.advantages, tokens.logp, tokens.active, config.stapo.tau_p)
        threshold = prepass.get(STAPO_THRESHOLD_KEY)
        if threshold is None:  # exact only when this call sees the whole mini-batch
            threshold = stapo_entropy_threshold(tokens.entropy, cand, config.stapo.entropy_quantile)
        spurious = stapo_spurious_mask(cand, tokens.entropy, threshold)
        tokens.masks["stapo/spurious"] = spurious
        tokens.active = tokens.active & ~spurious
        tokens.counted = tokens.counted & ~spurious
        tokens.metrics["loss/stapo/masked_frac"] = pair(spurious.sum(), tokens.num_valid)


@_register
class TRGRPO(TokenWeightMethod):
    """TR-GRPO (arXiv 2511.00066): ``w = clip(alpha * (sigmoid(p / tau) - mu), L, U)`` of the current p."""

    name = "tr_grpo"

    def enabled(self, config: AlgorithmConfig) -> bool:
        return config.tr_grpo.enabled

    def token_weight(self, tokens, config):
        weight = tr_grpo_weight(tokens.logp, config.tr_grpo)
        return TokenWeight(weight=weight, placement=config.tr_grpo.placement, metric="loss/tr_grpo/weight_mean")


# --------------------------------------------------------------------------- composition


def enabled_methods(config: AlgorithmConfig) -> list[TokenWeightMethod]:
    """The enabled methods, in composition order."""
    return [m for _, m in TOKEN_WEIGHT_METHODS.items() if m.enabled(config)]


def update_phases(config: AlgorithmConfig) -> tuple[str | None, ...]:
    """The phases of one RL step's update, in order: one full pass over the mini-batches
    per phase; ``(None,)`` when no enabled method defines phases."""
    phased = [m for m in enabled_methods(config) if m.phases(config)]
    if len(phased) > 1:
        names = ", ".join(m.name for m in phased)
        raise ValueError(f"at most one enabled method may split the update into phases; got {names}")
    return phased[0].phases(config) if phased else (None,)


def check_phase(config: AlgorithmConfig, phase: str | None) -> None:
    """Raise unless ``phase`` is one of :func:`update_phases` (naming the method's switch)."""
    phases = update_phases(config)
    if phase in phases:
        return
    if phases == (None,):
        switches = ", ".join(f"algorithm.{m.name}.enabled is false" for _, m in TOKEN_WEIGHT_METHODS.items()
                             if m.phases(config))  # fmt: skip
        raise ValueError(f"update phase {phase!r} given but no method with update phases is on ({switches})")
    owner = next(m for m in enabled_methods(config) if m.phases(config))
    raise ValueError(
        f"algorithm.{owner.name} is enabled: every update runs in one of its phases {list(phases)} "
        f"({owner.name}_phase); got phase={phase!r}"
    )


def old_logp_before_forward(config: AlgorithmConfig) -> bool:
    """Whether an enabled method reads the old log-probs before the train forward (AR's
    reweighting). Otherwise every method reads them inside the loss (Lopti's split) or in
    the pre-pass of the same weights, so an update whose weights are still the old policy's
    can take them from its own forward."""
    return any(m.reads_old_logp_before_forward(config) for m in enabled_methods(config))


def needs_prepass(config: AlgorithmConfig) -> bool:
    """Whether the loss needs :func:`prepass_statistics` of each mini-batch."""
    return any(m.needs_prepass(config) for m in enabled_methods(config))


def prepass_statistics(
    config: AlgorithmConfig, phase: str | None, parts: Sequence[PrepassTokens], group: dist.ProcessGroup | None = None
) -> dict[str, torch.Tensor]:
    """Mini-batch statistics for the loss from a forward-only pre-pass of the current policy.

    Within one optimizer step the weights do not change, so the pre-pass's log-probs and
    entropies equal those inside the loss. ``parts`` are this rank's micro-batches; the
    mini-batch may be spread over the ranks of ``group`` (data parallel), over which the
    statistics are gathered (collective: call on every rank of ``group``).
    """
    stats: dict[str, torch.Tensor] = {}
    for m in enabled_methods(config):
        if m.needs_prepass(config):
            stats.update(m.prepass_statistics(config, phase, parts, group))
    return stats


def select_tokens(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: AlgorithmConfig,
    *,
    phase: str | None,
    entropy: torch.Tensor | None = None,
    prepass: Mapping[str, torch.Tensor] | None = None,
    before: TokenWeightMethod | None = None,
) -> TokenSelection:
    """The tokens a loss call trains on and counts, after every enabled method's selection
    (or those before ``before``); inputs are sanitised to 0 outside ``mask``."""
    valid = mask.bool()
    zeros = torch.zeros_like(logp)
    tokens = TokenSelection(
        valid=valid,
        logp=torch.where(valid, logp, zeros),
        old_logp=torch.where(valid, old_logp.detach().to(logp.dtype), zeros),
        advantages=torch.where(valid, advantages.detach().to(logp.dtype), zeros),
        entropy=None if entropy is None else torch.where(valid, entropy, zeros),
    )
    if entropy is not None:
        # tokens.entropy is 0 where not valid: a plain sum (boolean indexing would sync a GPU)
        tokens.metrics["loss/entropy"] = pair(tokens.entropy.detach().to(torch.float64).sum(), tokens.num_valid)
    for method in enabled_methods(config):
        if method is before:
            break
        method.select(tokens, config, phase, prepass or {})
    return tokens
