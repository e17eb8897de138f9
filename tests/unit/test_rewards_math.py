"""The ``math`` reward: math-verify on the last ``\\boxed{}``."""

from __future__ import annotations

import threading
import time

import pytest

from megatron_rl.rewards.math_verify import MAX_ANSWER_CHARS, last_boxed
from megatron_rl.tasks.math import math_reward


@pytest.mark.parametrize(
    "response, truth, score",
    [
        ("so the answer is \\boxed{1/2}.", "0.5", 1.0),
        ("\\boxed{\\frac{1}{2}}", "1/2", 1.0),
        ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", 1.0),
        ("\\boxed{\\{1,2\\}}", "\\{2, 1\\}", 1.0),
        ("first \\boxed{3}, finally \\boxed{4}", "4", 1.0),
        ("first \\boxed{3}, finally \\boxed{4}", "3", 0.0),
        ("\\boxed{5} and then a cut-off \\boxed{6", "5", 1.0),
        ("\\boxed {7}", "\\boxed{7}", 1.0),
        ("\\boxed{7}", 7, 1.0),
        ("\\boxed{8}", {"answer": "8"}, 1.0),
        ("\\boxed{x + 1}", "1 + x", 1.0),
        ("\\boxed{2}", "3", 0.0),
    ],
)
def test_math_reward(response, truth, score):
    result = math_reward(response, truth)
    assert result.score == score and not result.parse_failed and not result.timed_out


@pytest.mark.parametrize(
    "response, reason",
    [
        ("the answer is 0.5", "no boxed answer"),
        ("\\boxed{ }", "empty"),
        ("\\boxed{" + "1+" * MAX_ANSWER_CHARS + "1}", "too long"),
        ("\\boxed{1", "no boxed answer"),
    ],
)
def test_parse_failures(response, reason):
    result = math_reward(response, "0.5")
    assert result.score == 0.0 and result.parse_failed and result.extras["answer"] == reason


def test_last_boxed():
    assert last_boxed("\\boxed{a{b}c} \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{\\}}") == "\\}"
    assert last_boxed("\\boxed") is None and last_boxed("") is None


def test_many_unbalanced_boxes_are_linear():
    start = time.monotonic()
    assert last_boxed("\\boxed{" * 20_000) is None
    assert last_boxed("\\boxed{1}" + "\\boxed{" * 20_000) == "1"
    assert time.monotonic() - start < 2.0  # a quadratic scan takes minutes here


def test_works_outside_the_main_thread():
    # math-verify's own limits use signal.alarm, which raises outside the main thread;
    # the reward turns them off there (the pool's hard limit still applies).
    out = []
    thread = threading.Thread(target=lambda: out.append(math_reward("\\boxed{1/2}", "0.5")))
    thread.start()
    thread.join(timeout=60)
    assert out and out[0].score == 1.0


def test_unparseable_ground_truth_raises():
    with pytest.raises(ValueError, match="math ground truth"):
        math_reward("\\boxed{1}", None)
