"""The pool's pure decisions: how a call is split, where a request goes, and when a
restarting engine counts as dead (``wait_until_back``'s policy, with Ray's answers scripted)."""

import pytest

from megatron_rl.rollout import RolloutEngineError, SamplingParams
from megatron_rl.rollout.pool.dispatch import pick_engine, split_requests
from megatron_rl.rollout.pool.recovery import DIED_FOR_GOOD_AFTER_S, wait_until_back

PARAMS = SamplingParams(n=2, max_new_tokens=5)


def test_split_is_contiguous_one_range_per_live_engine():
    prompts = [[1] * k for k in range(1, 8)]  # 7 prompts
    reqs = split_requests(prompts, PARAMS, num_live=3, max_prompts_per_request=None)
    assert [(r.lo, r.hi) for r in reqs] == [(0, 3), (3, 6), (6, 7)]
    assert [r.work for r in reqs] == [1 + 2 + 3 + 3 * 10, 4 + 5 + 6 + 3 * 10, 7 + 10]
    assert {r.num_requests for r in reqs} == {3} and [r.index for r in reqs] == [0, 1, 2]
    capped = split_requests(prompts, PARAMS, num_live=3, max_prompts_per_request=2)
    assert [(r.lo, r.hi) for r in capped] == [(0, 2), (2, 4), (4, 6), (6, 7)]
    # No live engine: one range (the caller reports that no engine is left).
    assert [(r.lo, r.hi) for r in split_requests(prompts, PARAMS, num_live=0, max_prompts_per_request=None)] == [(0, 7)]


def test_pick_least_outstanding_work_with_room():
    assert pick_engine([0, 1, 2], [30, 10, 10], [1, 1, 0], cap=2) == 2  # tie on work: fewer queued
    assert pick_engine([0, 1, 2], [30, 10, 10], [1, 2, 2], cap=2) == 0  # the others are full
    assert pick_engine([0, 2], [0, 0, 5], [0, 0, 0], cap=2) == 0  # engine 1 is not live
    assert pick_engine([0, 1], [1, 1], [2, 2], cap=2) is None


class _Scripted:
    """An actor handle whose ``health`` answers come from a script (Ray's errors or reports)."""

    def __init__(self, answers):
        self.answers = list(answers)
        self.calls = 0
        self.health = self

    def remote(self):
        self.calls += 1
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


@pytest.fixture
def scripted_ray(monkeypatch):
    ray = pytest.importorskip("ray")

    def get(answer, timeout=None):
        if isinstance(answer, BaseException):
            raise answer
        return answer

    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr("time.sleep", lambda s: None)
    return ray


def test_died_errors_while_a_restart_is_left_are_waited_out(scripted_ray):
    died = scripted_ray.exceptions.ActorDiedError()
    actor = _Scripted([died] * 5 + [{"pid": 2, "ok": True}])
    assert wait_until_back(actor, "e", timeout_s=60, replaces_pid=1, may_restart=True)["pid"] == 2
    assert actor.calls == 6


def test_died_three_times_without_a_restart_left_is_dead(scripted_ray):
    died = scripted_ray.exceptions.ActorDiedError()
    actor = _Scripted([died] * 5 + [{"pid": 2, "ok": True}])
    with pytest.raises(RolloutEngineError, match="e is dead and will not restart"):
        wait_until_back(actor, "e", timeout_s=60, replaces_pid=1, may_restart=False)
    assert actor.calls == 3


def test_the_killed_process_answering_is_not_the_engine_back(scripted_ray):
    unavailable = scripted_ray.exceptions.ActorUnavailableError("restarting", None)
    actor = _Scripted([{"pid": 1, "ok": True}, unavailable, {"pid": 3, "ok": True}])
    assert wait_until_back(actor, "e", timeout_s=60, replaces_pid=1, may_restart=True)["pid"] == 3


def test_a_failed_constructor_is_dead_at_once(scripted_ray):
    raised = scripted_ray.exceptions.RayTaskError("EngineWorker.__init__", "Traceback ...", ValueError("bad path"))
    died = scripted_ray.exceptions.ActorDiedError(raised)  # how Ray reports a constructor that raised
    assert died.actor_init_failed
    actor = _Scripted([died, {"pid": 2, "ok": True}])
    with pytest.raises(RolloutEngineError, match="will not restart"):
        wait_until_back(actor, "e", timeout_s=60, may_restart=True)
    assert actor.calls == 1


def test_died_errors_that_go_on_mean_dead_even_with_a_restart_counted(scripted_ray, monkeypatch):
    # The pool's count can miss a death; a restarting actor's calls fail as "unavailable",
    # not "died", so "died" for DIED_FOR_GOOD_AFTER_S means Ray gave the actor up.
    clock = [1000.0]
    monkeypatch.setattr("time.monotonic", lambda: clock[0])
    monkeypatch.setattr("time.sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    died = scripted_ray.exceptions.ActorDiedError()
    unavailable = scripted_ray.exceptions.ActorUnavailableError("restarting", None)
    # 20 s of "died", then "unavailable" (a restart after all: the window starts again),
    # then "died" for good.
    actor = _Scripted([died] * 41 + [unavailable] + [died])
    with pytest.raises(RolloutEngineError, match="e is dead and will not restart"):
        wait_until_back(actor, "e", timeout_s=600, replaces_pid=1, may_restart=True)
    assert clock[0] - 1000.0 == pytest.approx(20.5 + 0.2 + DIED_FOR_GOOD_AFTER_S, abs=1.0)


def test_a_hung_engine_is_charged_from_its_last_progress_only():
    import time

    from megatron_rl.rollout.pool.dispatch import Request, hung_engines, wait_timeout

    now = time.monotonic()
    reqs = [Request(index=i, lo=i, hi=i + 1, work=1, num_requests=3, engine=e) for i, e in enumerate((0, 0, 1))]
    progress_at = [now - 10.0, now - 1.0]  # engine 0 idle for 10 s, engine 1 progressed 1 s ago
    assert hung_engines(reqs, progress_at, limit=5.0) == [0]
    assert hung_engines(reqs, progress_at, limit=None) == [] and wait_timeout(reqs, progress_at, None) is None
    assert wait_timeout(reqs, progress_at, 5.0) == 0.0  # engine 0 is already over
    reqs[0].timed_out = True  # killed already: its requests fail when the kill lands
    assert hung_engines(reqs, progress_at, limit=5.0) == []
    assert 3.5 < wait_timeout(reqs, progress_at, 5.0) <= 4.0  # engine 1: 4 s left
