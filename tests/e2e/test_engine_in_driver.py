"""``rollout.engine_process: driver`` on the tiny demo: the whole run equals the Ray engine's.

The engine in the driver's process runs the same engine code on the same seeds and gets
the same weights each step, so every logged number of a run must equal the run with the
engine in a Ray actor of its own, step for step: synchronous (generate, then train) and
one-step-off (``max_staleness: 1``, where the driver's rollout-ahead thread generates
while the actor trains), evaluation and weight syncs included. Torch threads are pinned
to 1 in both (the default differs), so the arithmetic is the same.
"""

import os

import pytest

from tests.e2e.conftest import ASYNC, ASYNC_STEPS

# test_async_rollout.py's steps: its one-step-off run is this test's Ray-engine one (shared).
STEPS = (*ASYNC_STEPS, "parallel.cpu_threads=1")
COMPARED = ("rollout/reward/mean", "loss/total", "loss/pg_loss", "actor/grad_norm", "rollout/logp_mismatch/max_abs",
            "rollout/response_length/mean", "rollout/weight_version/min", "data/position")  # fmt: skip


@pytest.mark.parametrize("schedule", [(), ASYNC], ids=["synchronous", "one_step_off"])
def test_engine_in_the_driver_equals_the_ray_engine(tiny_run, schedule):
    ray_run = tiny_run(*STEPS, *schedule)
    driver_run = tiny_run(*STEPS, *schedule, "rollout.engine_process=driver")
    in_ray, in_driver = ray_run.rows, driver_run.rows
    assert driver_run.engine_pid == os.getpid() != ray_run.engine_pid
    assert sorted(in_driver) == sorted(in_ray) == [1, 2, 3, 4, 5]
    for step in in_ray:
        for key in COMPARED:
            assert in_driver[step][key] == in_ray[step][key], (step, key)
        assert in_driver[step]["weight_sync/num_engines"] == 1.0
    assert in_driver[3]["eval/accuracy/mean"] == in_ray[3]["eval/accuracy/mean"]
    if schedule:
        assert [in_driver[s]["rollout/staleness/max"] for s in (1, 2, 3, 4, 5)] == [0.0, 1.0, 1.0, 1.0, 1.0]
