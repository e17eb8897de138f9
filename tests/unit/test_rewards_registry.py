"""The reward registry, ``module:function`` loading, and how return values are normalised."""

from __future__ import annotations

import math
import uuid

import pytest

import megatron_rl.tasks  # noqa: F401  (registers the built-in rewards)
from megatron_rl.rewards import (
    RewardLoadError,
    RewardResult,
    UnknownRewardError,
    as_reward,
    call_reward,
    get_reward,
    register_reward,
    registered_rewards,
    reward,
)


@reward
def two_arg_reward(response, ground_truth):
    return float(response == ground_truth)


@reward(failure_score=-2.0, success_score=0.5)
def prompt_reward(response, ground_truth, *, prompt):
    return float(prompt == "P")


def kwargs_reward(response, ground_truth, **context):  # not declared: loaded from a trusted module
    return float(context.get("prompt") == "P")


@reward  # declared, so loading it by path gets as far as its signature (which is wrong)
def returns(value):
    """A reward returning ``value`` whatever it is given."""
    return lambda response, ground_truth: value


NOT_CALLABLE = 42


def test_builtins_are_registered():
    assert {"kk_logic", "math", "toy_copy"} <= set(registered_rewards())


def test_duplicate_registration_raises():
    name = f"test_dup_{uuid.uuid4().hex}"
    register_reward(name)(two_arg_reward)
    with pytest.raises(ValueError, match="already registered"):
        register_reward(name)(prompt_reward)
    assert get_reward(name).fn is two_arg_reward


@pytest.mark.parametrize("name", ["", "a:b"])
def test_bad_names(name):
    with pytest.raises(ValueError, match="contain no ':'"):
        register_reward(name)


def test_unknown_name_lists_registered():
    with pytest.raises(UnknownRewardError) as err:
        get_reward("no_such_reward")
    assert "unknown reward 'no_such_reward'" in str(err.value)
    assert "kk_logic" in str(err.value) and "math" in str(err.value)


def test_module_function_loads_and_adapts_to_the_signature():
    fn = get_reward(f"{__name__}:two_arg_reward")
    assert fn.fn is two_arg_reward and not fn.accepts_prompt and fn.failure_score == 0.0
    assert call_reward(fn, "a", "a", prompt="ignored").score == 1.0
    declared = get_reward(f"{__name__}:prompt_reward")
    assert call_reward(declared, "a", "b", prompt="P").score == 1.0
    assert (declared.failure_score, declared.success_score) == (-2.0, 0.5)
    trusted = get_reward(f"{__name__}:kwargs_reward", trusted_modules=["tests.unit"])
    assert call_reward(trusted, "a", "b", prompt="P").score == 1.0


# Importable callables that would run a response as code; a denylist cannot name them all.
@pytest.mark.parametrize("spec", ["cProfile:run", "profile:run", "timeit:timeit", "pdb:run", "webbrowser:open",
                                  f"{__name__}:kwargs_reward"])  # fmt: skip
def test_a_function_not_declared_a_reward_is_refused(spec):
    with pytest.raises(RewardLoadError, match="is not declared a reward, so model output is not passed to it"):
        get_reward(spec)


def test_a_trusted_module_does_not_admit_code_running_functions():
    with pytest.raises(RewardLoadError, match="refused"):
        get_reward("os:system", trusted_modules=["os"])
    with pytest.raises(RewardLoadError, match="refused"):
        get_reward(f"{__name__}:EVAL_ALIAS", trusted_modules=[__name__])


EVAL_ALIAS = eval  # a builtin re-exported under another module's name is refused too


@pytest.mark.parametrize(
    "spec, message",
    [
        ("no_such_module_qq:fn", "cannot import module 'no_such_module_qq': ModuleNotFoundError"),
        (f"{__name__}:missing", f"module '{__name__}' has no attribute 'missing'"),
        (f"{__name__}:NOT_CALLABLE", "'NOT_CALLABLE' is not callable (it is a int)"),
        (f"{__name__}:returns", "must accept (response, ground_truth"),
        ("a:b:c", "'package.module:function'"),
        (":fn", "'package.module:function'"),
        ("builtins:eval", "functions of 'builtins' are refused"),
        ("builtins:exec", "functions of 'builtins' are refused"),
        ("os:system", "functions of 'os' are refused"),
        ("subprocess:call", "functions of 'subprocess' are refused"),
        (f"{__name__}:EVAL_ALIAS", "it is Python's 'eval', which is refused"),
    ],
)
def test_module_function_errors_name_the_spec(spec, message):
    with pytest.raises(RewardLoadError) as err:
        get_reward(spec)
    assert f"reward {spec!r}" in str(err.value) and message in str(err.value)


@pytest.mark.parametrize(
    "value, score, failed",
    [
        (True, 1.0, False),
        (2, 2.0, False),
        (0.25, 0.25, False),
        (RewardResult(score=1, extras={"k": 1}), 1.0, False),
        (None, -7.0, True),
        ("1.0", -7.0, True),
        (float("nan"), -7.0, True),
        (RewardResult(score=math.inf), -7.0, True),
    ],
)
def test_return_values_are_normalised(value, score, failed):
    fn = as_reward(returns(value))
    fn = type(fn)(name=fn.name, fn=fn.fn, failure_score=-7.0, accepts_prompt=False)
    result = call_reward(fn, "r", "g")
    assert type(result.score) is float and result.score == score
    assert result.parse_failed == failed and (result.error is not None) == failed


def test_exceptions_score_the_failure_value():
    def boom(response, ground_truth):
        raise KeyError("no answer")

    boom.failure_score = -2.5
    result = call_reward(as_reward(boom), "r", "g")
    assert result.score == -2.5 and result.parse_failed and not result.timed_out
    assert result.error == "KeyError: 'no answer'"


def test_success_scores_of_the_builtins():
    from megatron_rl.rewards import get_reward

    assert get_reward("kk_logic").success_score == 3.0
    assert get_reward("math").success_score == 1.0
    assert get_reward("toy_copy").success_score == 1.0
