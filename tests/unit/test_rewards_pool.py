"""Time-limited batch scoring: time-outs, exceptions and dead workers score the failure value and are counted.

The user rewards below are module-level so that the spawned workers can import them
(``tests.unit.test_rewards_pool:misbehaving``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from megatron_rl.rewards import (
    AllRewardsFailedError,
    RewardErrorStreak,
    RewardPool,
    RewardResult,
    reward,
    score_batch,
)
from megatron_rl.tasks import get_reward

SPEC = f"{__name__}:misbehaving"


@reward(failure_score=-1.0)
def misbehaving(response, ground_truth):
    """Scores 1.0 for "ok"; otherwise hangs, raises, dies, eats memory or returns garbage as the response says."""
    if response == "hog":  # 2 GiB, written so that it is resident
        block = bytearray(2 << 30)
        block[:: 1 << 12] = b"x" * len(block[:: 1 << 12])
    elif response == "huge":
        return 1e308
    elif response == "oom_score_adj":
        return float(open("/proc/self/oom_score_adj").read())
    elif response == "hang":
        time.sleep(60)
    elif response == "raise":
        raise RuntimeError("bad answer")
    elif response == "die":
        os._exit(3)
    elif response == "nan":
        return float("nan")
    return 1.0



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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_reward_eating_memory_or_returning_an_absurd_score_fails_alone():
    responses = ["ok", "hog", "huge", "oom_score_adj", "ok"]
    with RewardPool(get_reward(SPEC), num_workers=1, timeout_s=30.0, memory_mb=512, max_abs_score=1e6) as pool:
        results = pool.score(responses, [None] * len(responses))
        worker = pool._workers[0].process.pid
        assert [r.score for r in results] == [1.0, -1.0, -1.0, 1000.0, 1.0]
        assert results[1].error.startswith("MemoryError")  # the cap, not the machine, stopped it
        assert results[2].error == f"ValueError: reward {SPEC!r} returned 1e+308, beyond ±1e+06 (data.max_abs_reward)"
        # The worker that hit its cap lives on (the reward got an exception); the driver is untouched.
        assert pool._workers[0].process.pid == worker
    assert int(open("/proc/self/oom_score_adj").read()) < 1000


def test_builtin_rewards_run_in_workers():
    scores, metrics = score_batch("math", ["\\boxed{1/2}", "no box", "\\boxed{3}"], ["0.5", "1", "4"], timeout_s=30.0)
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


def test_time_limits_that_would_overflow_the_waits_are_refused():
    for timeout_s in (float("inf"), 3e6):
        with pytest.raises(ValueError, match="timeouts must be in"):
            RewardPool("toy_copy", timeout_s=timeout_s)


# A parent that starts two workers, prints their pids, then has them score hanging responses
# (a busy worker never reads the pipe, so it cannot notice its parent is gone).
_PARENT = """
from megatron_rl.rewards import RewardPool
if __name__ == "__main__":
    pool = RewardPool("tests.unit.test_rewards_pool:misbehaving", num_workers=2, timeout_s=100)
    pool.score(["ok", "ok"], [None, None])
    print(" ".join(str(w.process.pid) for w in pool._workers), flush=True)
    pool.score(["hang", "hang"], [None, None])
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_die_with_their_parent_even_after_sigkill(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(_PARENT)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    parent = subprocess.Popen([sys.executable, str(script)], cwd=root, env=env, stdout=subprocess.PIPE, text=True)
    try:
        workers = [int(p) for p in parent.stdout.readline().split()]
        assert len(workers) == 2 and all(_alive(p) for p in workers)
        time.sleep(1.0)  # both are inside the hanging reward now
    finally:
        parent.send_signal(signal.SIGKILL)  # no clean-up code runs in the parent
        parent.wait()
    deadline = time.monotonic() + 5.0
    while any(_alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in workers)


def test_a_step_whose_every_reward_failed_k_times_in_a_row_stops():
    ok, failed = RewardResult(score=1.0), RewardResult(score=0.0, parse_failed=True, error="KeyError: 'answer'")
    streak = RewardErrorStreak(2)
    streak.update(1, [failed, failed])
    streak.update(2, [failed, ok])  # one scored response resets the count
    streak.update(3, [failed, failed])
    with pytest.raises(AllRewardsFailedError, match=r"2 steps in a row .*KeyError: 'answer'"):
        streak.update(4, [failed, failed])
    assert streak.state_dict() == {"reward_error_steps": 2}
    streak.load_state_dict({"reward_error_steps": 1})
    assert streak.count == 1
