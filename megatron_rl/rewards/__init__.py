"""Reward functions: the registry, user functions by import path, math-verify scoring, and
time-limited batch scoring.

The built-in rewards live with their tasks (:mod:`megatron_rl.tasks`): ``kk_logic``
(Logic-RL's K&K reward), ``math`` (math-verify on the last ``\\boxed{}``, scored by
:mod:`~megatron_rl.rewards.math_verify`) and ``toy_copy`` (the CPU demo task). They
register in :data:`~megatron_rl.rewards.registry.REWARDS` through the same
:func:`register_reward` as user rewards, when ``megatron_rl.tasks`` is imported; this
package never imports the tasks (they depend on it, not the other way round). So resolve a
built-in name with ``from megatron_rl.tasks import get_reward`` (this package's
:func:`get_reward`, re-exported), or import ``megatron_rl.tasks`` first.

It imports neither torch nor math-verify (math-verify is imported when first called), so
reward worker processes start fast. See ``docs/data_and_rewards.md``.
"""

from megatron_rl.rewards.pool import (
    DEFAULT_TIMEOUT_S,
    AllRewardsFailedError,
    RewardErrorStreak,
    RewardPool,
    score_batch,
    summarize,
)
from megatron_rl.rewards.registry import (
    REWARDS,
    RewardFunction,
    RewardLoadError,
    RewardResult,
    UnknownRewardError,
    as_reward,
    call_reward,
    get_reward,
    import_by_path,
    register_reward,
    registered_rewards,
    reward,
    reward_from_callable,
)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "AllRewardsFailedError",
    "REWARDS",
    "RewardFunction",
    "RewardErrorStreak",
    "RewardLoadError",
    "RewardPool",
    "RewardResult",
    "UnknownRewardError",
    "as_reward",
    "call_reward",
    "get_reward",
    "import_by_path",
    "reward",
    "register_reward",
    "registered_rewards",
    "reward_from_callable",
    "score_batch",
    "summarize",
]
