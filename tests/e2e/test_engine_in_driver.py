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

from megatron_rl.loop.pipeline import make_trainer
from megatron_rl.observability import read_metrics
from tests.e2e.conftest import tiny_config

STEPS = ("trainer.num_steps=4", "trainer.eval_every_steps=2", "trainer.save_every_steps=0", "parallel.cpu_threads=1")
ASYNC = ("rollout.placement=disaggregated", "rollout.max_staleness=1", "rollout.tis_cap=2.0")
COMPARED = ("rollout/reward/mean", "loss/total", "loss/pg_loss", "actor/grad_norm", "rollout/logp_mismatch/max_abs",
            "rollout/response_length/mean", "rollout/weight_version/min", "data/position")  # fmt: skip


def _run(out_dir, *extra):
    trainer = make_trainer(tiny_config(out_dir, *STEPS, *extra))
    try:
        engine_pid = trainer.parts.pool.health()[0]["pid"]
        trainer.run()
    finally:
        trainer.close()
    return engine_pid, {r["step"]: r for r in read_metrics(trainer.config.run_dir)}


@pytest.mark.parametrize("schedule", [(), ASYNC], ids=["synchronous", "one_step_off"])
def test_engine_in_the_driver_equals_the_ray_engine(tmp_path, ray_session, schedule):
    ray_pid, in_ray = _run(tmp_path / "ray", *schedule)
    driver_pid, in_driver = _run(tmp_path / "driver", *schedule, "rollout.engine_process=driver")
    assert driver_pid == os.getpid() != ray_pid
    assert sorted(in_driver) == sorted(in_ray) == [1, 2, 3, 4]
    for step in in_ray:
        for key in COMPARED:
            assert in_driver[step][key] == in_ray[step][key], (step, key)
        assert in_driver[step]["weight_sync/num_engines"] == 1.0
    for step in (2, 4):
        assert in_driver[step]["eval/accuracy/mean"] == in_ray[step]["eval/accuracy/mean"]
    if schedule:
        assert [in_driver[s]["rollout/staleness/max"] for s in (1, 2, 3, 4)] == [0.0, 1.0, 1.0, 1.0]
