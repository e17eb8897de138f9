"""Time-limited batch scoring: time-outs, exceptions and dead workers score the failure value and are counted.

The user rewards below are module-level so that the spawned workers can import them
(``tests.unit.test_rewards_pool:misbehaving``).
"""

from __future__ import annotations

import os
import time

import pytest

from megatron_rl.rewards import RewardPool, score_batch
from megatron_rl.tasks import get_reward

SPEC = f"{__name__}:misbehaving"


def misbehaving(response, ground_truth):
    """Scores 1.0 for "ok"; otherwise hangs, raises, dies or returns garbage as the response says."""
    if response == "hang":
        time.sleep(60)
    elif response == "raise":
        raise RuntimeError("bad answer")
    elif response == "die":
        os._exit(3)
    elif response == "nan":
        return float("nan")
    return 1.0


misbehaving.failure_score = -1.0


def test_slow_reward_times_out_and_is_counted():
    start = time.monotonic()
    scores, metrics = score_batch(SPEC, ["ok", "hang", "ok"], [None] * 3, timeout_s=1.0)
    assert scores == [1.0, -1.0, 1.0]
    assert metrics == {"reward/parse_failures": 1, "reward/timeouts": 1, "reward/exceptions": 0}
    assert time.monotonic() - start < 30  # the 60 s sleep was cut short


def test_every_failure_kind_in_one_pool():
    responses = ["ok", "hang", "raise", "die", "nan", "ok", "ok"]
    with RewardPool(get_reward(SPEC), num_workers=2, timeout_s=1.0) as pool:
        results = pool.score(responses, [None] * len(responses), prompts=["p"] * len(responses))
        assert [r.score for r in results] == [1.0, -1.0, -1.0, -1.0, -1.0, 1.0, 1.0]
        assert [r.timed_out for r in results] == [False, True, False, False, False, False, False]
        assert results[2].error == "RuntimeError: bad answer"
        assert "died" in results[3].error and "exit code 3" in results[3].error
        assert "non-finite" in results[4].error
        _, metrics = score_batch(SPEC, responses, [None] * len(responses), pool=pool)
        assert metrics == {"reward/parse_failures": 4, "reward/timeouts": 1, "reward/exceptions": 3}
        # workers are replaced, so the pool keeps working
        assert [r.score for r in pool.score(["ok"] * 3, [None] * 3)] == [1.0] * 3
    with pytest.raises(RuntimeError, match="closed"):
        pool.score(["ok"], [None])


def test_builtin_rewards_run_in_workers():
    scores, metrics = score_batch(
        "math", ["\\boxed{1/2}", "no box", "\\boxed{3}"], ["0.5", "1", "4"], timeout_s=30.0
    )
    assert scores == [1.0, 0.0, 0.0] and metrics["reward/parse_failures"] == 1


def test_inline_scoring_without_time_limit():
    gt = {"solution": {"Zoey": "knight"}}
    scores, metrics = score_batch(
        "kk_logic", ["x</think><answer>Zoey is a knight</answer>", "no tags"], [gt, gt],
        prompts=["<think>", "<think>"], timeout_s=None,
    )  # fmt: skip
    assert scores == [3.0, -3.0] and metrics["reward/parse_failures"] == 1


def test_argument_errors():
    with pytest.raises(ValueError, match="cannot be sent to a worker"):
        RewardPool(lambda response, ground_truth: 0.0)
    with pytest.raises(ValueError, match="equal"):
        score_batch("toy_copy", ["a", "b"], ["a"], timeout_s=None)
    with RewardPool("toy_copy") as pool:
        with pytest.raises(ValueError, match="pool scores 'toy_copy', not 'math'"):
            score_batch("math", ["a"], ["a"], pool=pool)
        with pytest.raises(ValueError, match="need equal counts"):
            pool.score(["a"], ["a", "b"])


def test_a_worker_that_died_while_idle_is_replaced():
    with RewardPool(get_reward(SPEC), timeout_s=5.0) as pool:
        assert [r.score for r in pool.score(["ok"], [None])] == [1.0]
        (worker,) = pool._workers
        worker.process.kill()  # e.g. the OOM killer between two batches
        worker.process.join()
        assert [r.score for r in pool.score(["ok", "ok"], [None, None])] == [1.0, 1.0]
