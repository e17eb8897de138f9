"""Tasks: one module per kind of prompt, bundling its generator, prompt style, reward and
eval grouping (config ``data.task``).

Importing this package registers the built-in tasks, and with them the built-in rewards
(in :data:`megatron_rl.rewards.REWARDS`, under the same names):

- ``kk_logic`` (:mod:`~megatron_rl.tasks.kk`): Knights-and-Knaves puzzles, Logic-RL's
  system prompt with a ``<think>`` pre-fill, Logic-RL's reward, eval accuracy per puzzle
  size; ``megatron-rl generate-data kk``.
- ``math`` (:mod:`~megatron_rl.tasks.math`): the Qwen-math instruction, math-verify on the
  last ``\\boxed{}``.
- ``toy_copy`` (:mod:`~megatron_rl.tasks.toy`): the CPU demo's copy-the-digits task and its
  tokenizer; ``megatron-rl generate-data toy``.

A user task registers the same way as these: ``register_task(Task(name=..., reward=
get_reward(...), prompt_style=..., eval_group=...))``, or is named in a config as
``package.module:attr`` (a :class:`Task` instance, or a plain reward function, which
becomes a task with no system prompt, no pre-fill and eval group ``all``); see
:func:`get_task`.

:func:`get_reward` is :func:`megatron_rl.rewards.get_reward` re-exported: importing it from
here guarantees the built-in reward names resolve (``megatron_rl.rewards`` never imports
this package). Nothing here imports torch or math-verify.
"""

from megatron_rl.rewards.registry import get_reward
from megatron_rl.tasks.base import (
    TASKS,
    DataGenerator,
    Splits,
    Task,
    UnknownTaskError,
    all_rows,
    get_task,
    register_task,
    registered_tasks,
)

# The built-ins register on import, in this order (also the order of ``generate-data``'s tasks).
from megatron_rl.tasks import kk as _kk  # noqa: E402,F401  isort: skip
from megatron_rl.tasks import math as _math  # noqa: E402,F401  isort: skip
from megatron_rl.tasks import toy as _toy  # noqa: E402,F401  isort: skip

__all__ = [
    "TASKS",
    "DataGenerator",
    "Splits",
    "Task",
    "UnknownTaskError",
    "all_rows",
    "get_reward",
    "get_task",
    "register_task",
    "registered_tasks",
]
