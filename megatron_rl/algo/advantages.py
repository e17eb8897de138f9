"""Outcome-reward advantage estimators and their registry.

Every estimator maps one scalar reward per response to one advantage per response;
:func:`broadcast_to_tokens` then gives every response token its response's advantage.

How each follows its source (``docs/algorithms.md`` has the details):

- ``grpo``: ``A_i = (R_i - mean_g) / (std_g + eps)`` with the UNBIASED std of the group,
  as the AR/Lopti runs (verl) do. A group of one gets ``A = 0`` by default; the reference
  code instead uses mean 0 / std 1 (``A = R / (1 + eps)``), available as
  ``single_sample_group="raw_reward"``.
- ``dr_grpo``: ``A_i = R_i - mean_g`` (Dr.GRPO drops the std division).
- ``rloo``: ``A_i = R_i - mean_{j != i} R_j = G / (G - 1) * (R_i - mean_g)``.
- ``reinforce_pp``: REINFORCE++ for outcome rewards: no per-group baseline, rewards
  whitened over the whole batch of responses, ``(R - mean_B) / (std_B + eps)``.
  (OpenRLHF whitens per token after adding a per-token KL penalty; with an outcome
  reward broadcast to tokens and KL kept in the loss we whiten per response, so long
  responses do not weigh more in the statistics.)

All estimators are pure functions of float tensors; they run in float64 internally so
the advantage does not depend on the reward dtype, and return the rewards' dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from megatron_rl.algo.config import AdvantageConfig
from megatron_rl.config.lib import Registry, UnknownNameError


class AdvantageEstimator(Protocol):
    def __call__(
        self, rewards_N: torch.Tensor, group_index_N: torch.Tensor, config: AdvantageConfig
    ) -> torch.Tensor: ...


class UnknownEstimatorError(UnknownNameError):
    """Raised for a name that no estimator is registered under; lists the registered ones."""


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry(
    "advantage estimator", unknown_error=UnknownEstimatorError
)
"""Estimators by name (``algorithm.advantage.estimator``)."""


def register_advantage(name: str) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Decorator registering an estimator under ``name``; a second registration raises.

    Built-ins register through this same decorator, so a user estimator is a peer, e.g.::

        @register_advantage("my_baseline")
        def my_baseline(rewards_N, group_index_N, config): ...
    """
    return ADVANTAGE_ESTIMATORS.register(name)


def registered_advantages() -> list[str]:
    """Names of all registered estimators, sorted."""
    return ADVANTAGE_ESTIMATORS.names()


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered under ``name``; :class:`UnknownEstimatorError` lists the others."""
    return ADVANTAGE_ESTIMATORS.get(name)


def compute_advantages(rewards_N: torch.Tensor, group_index_N: torch.Tensor, config: AdvantageConfig) -> torch.Tensor:
    """Per-response advantages with the configured estimator.

    Args:
        rewards_N: ``[N]`` float rewards, one per response.
        group_index_N: ``[N]`` integer id of the prompt each response answers; responses
            with equal ids form a group. Ids need not be contiguous or sorted.
        config: estimator name and its constants.

    Returns:
        ``[N]`` advantages, dtype of ``rewards_N``.
    """
    if rewards_N.dim() != 1 or group_index_N.shape != rewards_N.shape:
        raise ValueError(
            f"rewards_N and group_index_N must both be [N]; got {tuple(rewards_N.shape)} "
            f"and {tuple(group_index_N.shape)}"
        )
    if not torch.isfinite(rewards_N).all():
        bad = torch.nonzero(~torch.isfinite(rewards_N)).flatten().tolist()
        raise ValueError(f"non-finite rewards at response indices {bad[:10]}")
    return get_advantage_estimator(config.estimator)(rewards_N, group_index_N, config)


def broadcast_to_tokens(advantages_N: torch.Tensor, response_mask_NT: torch.Tensor) -> torch.Tensor:
    """``[N]`` response advantages -> ``[N, T]`` token advantages, 0 where the mask is 0.

    Keeps the dtype of ``advantages_N`` (float64 from float64 rewards, as
    :func:`compute_advantages` returns them); a consumer that computes in another dtype
    casts once, where it computes (the fused loss casts to the log-probs' dtype).
    """
    mask_NT = response_mask_NT.bool()
    return torch.where(mask_NT, advantages_N[:, None], advantages_N.new_zeros(()))


def _group_stats(
    rewards_N: torch.Tensor, group_index_N: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-response group size, group mean and UNBIASED group std (0 for groups of one), float64."""
    _, inverse_N = torch.unique(group_index_N, return_inverse=True)
    num_groups = int(inverse_N.max()) + 1 if inverse_N.numel() else 0
    r = rewards_N.to(torch.float64)
    size_G = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, inverse_N, torch.ones_like(r))
    mean_G = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, inverse_N, r) / size_G
    dev_N = r - mean_G[inverse_N]
    sq_G = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, inverse_N, dev_N * dev_N)
    var_G = torch.where(size_G > 1, sq_G / (size_G - 1).clamp(min=1), torch.zeros_like(sq_G))
    return size_G[inverse_N], mean_G[inverse_N], var_G.sqrt()[inverse_N]


def _single_sample(r: torch.Tensor, config: AdvantageConfig) -> torch.Tensor:
    """Advantage of a response alone in its group (see ``AdvantageConfig.single_sample_group``)."""
    if config.single_sample_group == "zero":
        return torch.zeros_like(r)
    return r / (1.0 + config.eps)


@register_advantage("grpo")
def grpo_advantages(rewards_N: torch.Tensor, group_index_N: torch.Tensor, config: AdvantageConfig) -> torch.Tensor:
    """``(R - mean_g) / (std_g + eps)``, unbiased std; see the module docstring for groups of one."""
    size, mean, std = _group_stats(rewards_N, group_index_N)
    r = rewards_N.to(torch.float64)
    adv = torch.where(size > 1, (r - mean) / (std + config.eps), _single_sample(r, config))
    return adv.to(rewards_N.dtype)


@register_advantage("dr_grpo")
def dr_grpo_advantages(rewards_N: torch.Tensor, group_index_N: torch.Tensor, config: AdvantageConfig) -> torch.Tensor:
    """``R - mean_g`` (Dr.GRPO: no std normalisation)."""
    size, mean, _ = _group_stats(rewards_N, group_index_N)
    r = rewards_N.to(torch.float64)
    adv = torch.where(size > 1, r - mean, _single_sample(r, config))
    return adv.to(rewards_N.dtype)


@register_advantage("rloo")
def rloo_advantages(rewards_N: torch.Tensor, group_index_N: torch.Tensor, config: AdvantageConfig) -> torch.Tensor:
    """Leave-one-out baseline: ``R_i - mean_{j != i} R_j``."""
    size, mean, _ = _group_stats(rewards_N, group_index_N)
    r = rewards_N.to(torch.float64)
    loo = size / (size - 1).clamp(min=1) * (r - mean)
    adv = torch.where(size > 1, loo, _single_sample(r, config))
    return adv.to(rewards_N.dtype)


@register_advantage("reinforce_pp")
def reinforce_pp_advantages(
    rewards_N: torch.Tensor, group_index_N: torch.Tensor, config: AdvantageConfig
) -> torch.Tensor:
    """REINFORCE++: rewards whitened over the whole batch, ``(R - mean_B) / (std_B + eps)``."""
    r = rewards_N.to(torch.float64)
    if r.numel() < 2:
        return _single_sample(r, config).to(rewards_N.dtype)
    adv = (r - r.mean()) / (r.std(unbiased=True) + config.eps)
    return adv.to(rewards_N.dtype)
