"""Reward functions (registry, K&K, math, toy) and time-limited batch scoring.

Importing this package registers the built-ins: ``kk_logic`` (Logic-RL's K&K reward),
``math`` (math-verify on the last ``\\boxed{}``) and ``toy_copy`` (the CPU demo task).
It imports neither torch nor math-verify (the ``math`` reward imports it when first
called), so reward worker processes start fast. See ``docs/data_and_rewards.md``.
"""

from megatron_rl.rewards import kk_logic as _kk_logic  # noqa: F401  (registers kk_logic)
from megatron_rl.rewards import math as _math  # noqa: F401  (registers math)
from megatron_rl.rewards import toy as _toy  # noqa: F401  (registers toy_copy)
from megatron_rl.rewards.pool import DEFAULT_TIMEOUT_S, RewardPool, score_batch, summarize
from megatron_rl.rewards.registry import (
    RewardFunction,
    RewardLoadError,
    RewardResult,
    UnknownRewardError,
    as_reward,
    call_reward,
    get_reward,
    register_reward,
    registered_rewards,
)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "RewardFunction",
    "RewardLoadError",
    "RewardPool",
    "RewardResult",
    "UnknownRewardError",
    "as_reward",
    "call_reward",
    "get_reward",
    "register_reward",
    "registered_rewards",
    "score_batch",
    "summarize",
]
