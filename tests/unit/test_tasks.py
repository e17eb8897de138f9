"""Tasks (``megatron_rl.tasks``): the registry, ``get_task`` resolution, the built-ins'
styles, rewards and eval groups, and which way the dependencies point."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from megatron_rl.config.lib import UnknownNameError
from megatron_rl.data.loaders import PromptRow
from megatron_rl.data.prompts import PLAIN_STYLE, PromptStyle
from megatron_rl.rewards import REWARDS, RewardLoadError, registered_rewards, reward
from megatron_rl.tasks import (
    TASKS,
    Task,
    UnknownTaskError,
    get_reward,
    get_task,
    register_task,
    registered_tasks,
)
from megatron_rl.tasks.kk import KK_STYLE, KK_SYSTEM_PROMPT
from megatron_rl.tasks.math import MATH_STYLE

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_rl"
BUILTINS = ("kk_logic", "math", "toy_copy")


@reward(failure_score=-1.0)
def two_arg_reward(response, ground_truth):
    return float(response == ground_truth)

USER_TASK = Task(
    name="user_echo",
    reward=get_reward(f"{__name__}:two_arg_reward"),
    prompt_style=PromptStyle(system_prompt="Echo the question."),
    eval_group=lambda row: row.metadata.get("level", "all"),
)

NOT_CALLABLE = 42


def _row(**metadata) -> PromptRow:
    return PromptRow(prompt="Q", ground_truth="A", file="f.jsonl", row=1, metadata=metadata)


def test_builtins_are_registered_with_their_rewards():
    assert set(BUILTINS) <= set(registered_tasks()) and set(BUILTINS) <= set(registered_rewards())
    for name in BUILTINS:
        task = get_task(name)
        assert task.name == name and task.reward is get_reward(name) is REWARDS.get(name)
    assert [name for name, _ in TASKS.items()][:3] == list(BUILTINS)  # registration order


def test_styles_by_task():
    assert get_task("kk_logic").prompt_style is KK_STYLE and get_task("math").prompt_style is MATH_STYLE
    assert get_task("toy_copy").prompt_style is PLAIN_STYLE
    assert get_task(f"{__name__}:two_arg_reward").prompt_style is PLAIN_STYLE
    # the K&K system prompt asks for exactly what kk_logic parses
    for piece in ("<think> </think>", "<answer> </answer>", "(1) Zoey is a knight\n(2) ..."):
        assert piece in KK_SYSTEM_PROMPT


def test_eval_groups():
    kk = get_task("kk_logic")
    assert kk.eval_group(_row(num_people=3)) == "n3" and kk.eval_group(_row(id="x")) == "all"
    for name in ("math", "toy_copy", f"{__name__}:two_arg_reward"):
        assert get_task(name).eval_group(_row(num_people=3)) == "all"


def test_generators_of_the_builtins():
    assert get_task("kk_logic").generator.command == "kk"
    assert get_task("toy_copy").generator.command == "toy"
    assert get_task("math").generator is None


def test_a_user_reward_function_is_a_plain_task():
    spec = f"{__name__}:two_arg_reward"
    task = get_task(spec)
    assert task.name == spec and task.reward.fn is two_arg_reward and task.reward.failure_score == -1.0
    assert task.prompt_style == PLAIN_STYLE and task.generator is None
    assert spec not in TASKS


def test_a_user_task_instance_is_used_as_is():
    assert get_task(f"{__name__}:USER_TASK") is USER_TASK
    assert USER_TASK.eval_group(_row(level="hard")) == "hard"


def test_register_task_like_the_builtins():
    name = f"test_task_{uuid.uuid4().hex}"
    task = register_task(Task(name=name, reward=get_reward("toy_copy")))
    assert get_task(name) is task and name in registered_tasks()
    with pytest.raises(ValueError, match="already registered"):
        register_task(Task(name=name, reward=get_reward("math")))
    with pytest.raises(ValueError, match="contain no ':'"):
        register_task(Task(name="a:b", reward=get_reward("math")))


def test_unknown_task_lists_registered():
    with pytest.raises(UnknownTaskError) as err:
        get_task("kk_logik")
    assert isinstance(err.value, UnknownNameError)
    message = str(err.value)
    assert message.startswith("unknown task 'kk_logik'; registered: ") and "'package.module:name'" in message
    for name in BUILTINS:
        assert name in message


@pytest.mark.parametrize(
    "spec, message",
    [
        ("no_such_module_qq:fn", "cannot import module 'no_such_module_qq'"),
        (f"{__name__}:missing", f"module '{__name__}' has no attribute 'missing'"),
        (f"{__name__}:NOT_CALLABLE", "'NOT_CALLABLE' is not callable (it is a int)"),
    ],
)
def test_module_specs_that_do_not_load_name_the_spec(spec, message):
    with pytest.raises(RewardLoadError) as err:
        get_task(spec)
    assert f"reward {spec!r}" in str(err.value) and message in str(err.value)


def test_importing_the_rewards_registers_no_task_and_tasks_need_no_torch():
    code = (
        "import sys, megatron_rl.rewards as r; assert 'megatron_rl.tasks' not in sys.modules; "
        "assert 'kk_logic' not in r.registered_rewards(); import megatron_rl.tasks; "
        "assert 'kk_logic' in r.registered_rewards(); assert 'torch' not in sys.modules"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
