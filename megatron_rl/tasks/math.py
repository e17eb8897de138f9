"""The ``math`` task: the Qwen-math prompt style and math-verify on the last ``\\boxed{}``.

Registered as task ``math`` (and its reward as reward ``math``: 1.0 right, 0.0 wrong or
unparseable; failure score 0.0) when :mod:`megatron_rl.tasks` is imported. The scoring
itself, and what counts as the answer, is :func:`megatron_rl.rewards.math_verify.score_math`.
Rows are reported in one eval group, ``all``; there is no generator (bring your own data).
"""

from __future__ import annotations

from typing import Any

from megatron_rl.data.prompts import PromptStyle
from megatron_rl.rewards.math_verify import score_math
from megatron_rl.rewards.registry import RewardResult, get_reward, register_reward
from megatron_rl.tasks.base import Task, register_task

MATH_STYLE = PromptStyle(
    system_prompt="Please reason step by step, and put your final answer within \\boxed{}."
)  # fmt: skip
"""Math: the usual Qwen-math instruction, so that the ``math`` reward finds a ``\\boxed{}``."""


@register_reward("math", failure_score=0.0, success_score=1.0)
def math_reward(response: str, ground_truth: Any) -> RewardResult:
    """math-verify on the last ``\\boxed{}``: 1.0 right, 0.0 wrong or unparseable."""
    return score_math(response, ground_truth)


TASK = register_task(Task(name="math", reward=get_reward("math"), prompt_style=MATH_STYLE))
"""The ``math`` task."""
