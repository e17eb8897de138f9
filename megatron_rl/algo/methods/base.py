"""What a token-weight method is: the hooks it may implement, the per-token state they
read and narrow, and the registry that lists the methods in the order they compose.

A method reads only its own ``algorithm`` sub-section (``section``: an instance of its
``config_class``, the field of ``AlgorithmConfig`` named like the method); the composition
(``compose.py``) hands each hook that section. Shapes: every per-token tensor is ``[*S]``
(``[N, T]`` padded or ``[T]`` packed).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist

from megatron_rl.config.lib import Registry

__all__ = [
    "TOKEN_WEIGHT_METHODS",
    "PrepassTokens",
    "TokenSelection",
    "TokenWeight",
    "TokenWeightMethod",
    "pair",
    "register_method",
]


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
    """One token-weight method; every hook defaults to "does nothing" (and :meth:`enabled`
    to the section's ``enabled``).

    A method can:

    - reweight the advantages once per RL step, before any update, from the old
      log-probs (:meth:`reweight_advantages`: Advantage Reweighting);
    - split each RL step's update into phases, run in order, each a full pass over the
      mini-batches with its own optimizer steps (:meth:`phases`: Lopti);
    - narrow, inside the loss, which tokens a call trains on (``active``) and which count
      in its normaliser (``counted``) (:meth:`select`: Lopti's phase, STAPO's spurious
      tokens);
    - need a statistic of the whole mini-batch from a forward-only pre-pass of the
      current policy before the loss runs (:meth:`prepass_statistics`: STAPO's entropy
      threshold, a quantile over the mini-batch);
    - weight each token's objective (:meth:`token_weight`: TR-GRPO).
    """

    name: str = ""
    """Registry name; also the ``algorithm`` field holding the method's section."""
    config_class: type = object
    """The class of the method's ``algorithm.<name>`` section."""

    def enabled(self, section: Any) -> bool:
        """Whether the method is on: its section's ``enabled`` (each built-in section has one)."""
        return bool(section.enabled)

    def phases(self, section: Any) -> tuple[str, ...]:
        """The update phases, in the order they run (empty: no phases)."""
        return ()

    def reweight_advantages(
        self, advantages: torch.Tensor, old_logp: torch.Tensor, valid: torch.Tensor, section: Any
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Once per RL step, before any update."""
        return advantages, {}

    def reads_old_logp_before_forward(self, section: Any) -> bool:
        """Whether the method reads the old log-probs before the train forward runs (so the
        first update cannot take them from that forward)."""
        return False

    def needs_entropy(self, section: Any) -> bool:
        """Whether :meth:`select` reads the current full-distribution entropy."""
        return False

    def needs_prepass(self, section: Any) -> bool:
        return False

    def prepass_statistics(
        self, section: Any, parts: Sequence[TokenSelection], group: dist.ProcessGroup | None
    ) -> dict[str, torch.Tensor]:
        """Statistics of the whole mini-batch: ``parts`` are this rank's micro-batches as
        the methods composed before this one selected them (entropy included); the
        mini-batch may be spread over the ranks of ``group``."""
        return {}

    def select(
        self, tokens: TokenSelection, section: Any, phase: str | None, prepass: Mapping[str, torch.Tensor]
    ) -> None:
        """Narrow ``tokens.active`` / ``tokens.counted`` (in place) and add metrics."""

    def token_weight(self, tokens: TokenSelection, section: Any) -> TokenWeight | None:
        return None

    def config_warnings(self, section: Any, algorithm: Any) -> Iterator[tuple[str, str]]:
        """``(path relative to algorithm, message)`` of settings that are legal but
        ignored or unusual with this method on (the run config warns with them)."""
        return iter(())


TOKEN_WEIGHT_METHODS: Registry[TokenWeightMethod] = Registry("token-weight method")
"""The methods, in the order they compose (the order ``algo/config.py`` imports them)."""


def register_method(cls: type[TokenWeightMethod]) -> type[TokenWeightMethod]:
    """Class decorator: register one instance of ``cls`` under ``cls.name``."""
    TOKEN_WEIGHT_METHODS.register(cls.name, cls())
    return cls
