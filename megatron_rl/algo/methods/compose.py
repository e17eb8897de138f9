"""How the enabled token-weight methods compose into one update and one loss.

The actor, the policy loss and the trainer call only these generic entry points and
never name a method, so a new method is one more file in this package (its section
added to ``AlgorithmConfig``). Methods compose in registration order; at most one
enabled method may define update phases (two would need an order between them that no
paper specifies).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl.algo.config import AlgorithmConfig
from megatron_rl.algo.methods.base import (
    TOKEN_WEIGHT_METHODS,
    PrepassTokens,
    TokenSelection,
    TokenWeight,
    TokenWeightMethod,
    pair,
)

__all__ = [
    "check_phase",
    "config_warnings",
    "enabled_methods",
    "needs_prepass",
    "old_logp_before_forward",
    "prepass_statistics",
    "reweight_advantages",
    "select_tokens",
    "token_weights",
    "update_phases",
]


def _section(method: TokenWeightMethod, config: AlgorithmConfig) -> Any:
    """The method's own ``algorithm.<name>`` section; the whole section for a method
    registered at run time that has none."""
    return getattr(config, method.name) if method.name in config.__dataclass_fields__ else config


def enabled_methods(config: AlgorithmConfig) -> list[TokenWeightMethod]:
    """The enabled methods, in composition order."""
    return [m for _, m in TOKEN_WEIGHT_METHODS.items() if m.enabled(_section(m, config))]


def update_phases(config: AlgorithmConfig) -> tuple[str | None, ...]:
    """The phases of one RL step's update, in order: one full pass over the mini-batches
    per phase; ``(None,)`` when no enabled method defines phases."""
    phased = [m for m in enabled_methods(config) if m.phases(_section(m, config))]
    if len(phased) > 1:
        names = ", ".join(m.name for m in phased)
        raise ValueError(f"at most one enabled method may split the update into phases; got {names}")
    return phased[0].phases(_section(phased[0], config)) if phased else (None,)


def check_phase(config: AlgorithmConfig, phase: str | None) -> None:
    """Raise unless ``phase`` is one of :func:`update_phases` (naming the method's switch)."""
    phases = update_phases(config)
    if phase in phases:
        return
    if phases == (None,):
        switches = ", ".join(f"algorithm.{m.name}.enabled is false" for _, m in TOKEN_WEIGHT_METHODS.items()
                             if m.phases(_section(m, config)))  # fmt: skip
        raise ValueError(f"update phase {phase!r} given but no method with update phases is on ({switches})")
    owner = next(m for m in enabled_methods(config) if m.phases(_section(m, config)))
    raise ValueError(
        f"algorithm.{owner.name} is enabled: every update runs in one of its phases {list(phases)} "
        f"({owner.name}_phase); got phase={phase!r}"
    )


def old_logp_before_forward(config: AlgorithmConfig) -> bool:
    """Whether an enabled method reads the old log-probs before the train forward (AR's
    reweighting). Otherwise every method reads them inside the loss (Lopti's split) or in
    the pre-pass of the same weights, so an update whose weights are still the old policy's
    can take them from its own forward."""
    return any(m.reads_old_logp_before_forward(_section(m, config)) for m in enabled_methods(config))


def needs_prepass(config: AlgorithmConfig) -> bool:
    """Whether the loss needs :func:`prepass_statistics` of each mini-batch."""
    return any(m.needs_prepass(_section(m, config)) for m in enabled_methods(config))


def reweight_advantages(
    config: AlgorithmConfig, advantages: torch.Tensor, old_logp: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Every enabled method's once-per-step advantage reweighting, in order; ``[*S]`` in and out."""
    metrics: dict[str, torch.Tensor] = {}
    for method in enabled_methods(config):
        advantages, m = method.reweight_advantages(advantages, old_logp, valid, _section(method, config))
        metrics.update(m)
    return advantages, metrics


def prepass_statistics(
    config: AlgorithmConfig, phase: str | None, parts: Sequence[PrepassTokens], group: dist.ProcessGroup | None = None
) -> dict[str, torch.Tensor]:
    """Mini-batch statistics for the loss from a forward-only pre-pass of the current policy.

    Within one optimizer step the weights do not change, so the pre-pass's log-probs and
    entropies equal those inside the loss. ``parts`` are this rank's micro-batches; each
    method that needs statistics sees them as the methods before it selected them. The
    mini-batch may be spread over the ranks of ``group`` (data parallel), over which the
    statistics are gathered (collective: call on every rank of ``group``).
    """
    stats: dict[str, torch.Tensor] = {}
    for m in enabled_methods(config):
        if m.needs_prepass(_section(m, config)):
            selected = [
                select_tokens(p.logp, p.old_logp, p.advantages, p.mask, config, phase=phase, entropy=p.entropy, before=m)
                for p in parts
            ]  # fmt: skip
            stats.update(m.prepass_statistics(_section(m, config), selected, group))
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
        method.select(tokens, _section(method, config), phase, prepass or {})
    return tokens


def token_weights(tokens: TokenSelection, config: AlgorithmConfig) -> list[TokenWeight]:
    """The enabled methods' stop-gradient per-token weights, in order."""
    weights = (m.token_weight(tokens, _section(m, config)) for m in enabled_methods(config))
    return [w for w in weights if w is not None]


def config_warnings(config: AlgorithmConfig) -> Iterator[tuple[str, str]]:
    """``(path relative to the algorithm section, message)`` of every enabled method's
    warnings about the rest of the section."""
    for m in enabled_methods(config):
        yield from m.config_warnings(_section(m, config), config)
