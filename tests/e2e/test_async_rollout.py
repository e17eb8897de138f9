"""Rollout ahead of the update (``rollout.max_staleness: 1``, disaggregated) on the tiny demo.

* the first step equals the synchronous run's (both generate it on the initial weights);
  every later step trains on responses exactly one version old, and the data cursor
  advances by one batch per step (no prompt skipped or repeated);
* both sides' waiting is measured (``timing_s/actor_wait_rollout``, ``timing_s/rollout_wait_actor``);
* submitting the next step's update before this step is logged (``PipelinedTrainer``'s
  ``submit_early``)
  and the shared-memory weight transport change no number: the run equals one that
  submits each update at its own step and syncs through the object store, step for step;
* kill -9 while a batch is generated ahead, then resume: each step (and the evaluation
  before training, ``trainer.eval_before_train``) is logged once and
  trains the prompts the uninterrupted run trains at that step (the batches that were
  queued or in flight are drawn again), with no response older than one version.
(That it learns like the synchronous run, over 3 seeds: tests/e2e/test_demo_learns.py.)
"""

from megatron_rl.loop.pipeline import PipelinedTrainer
from megatron_rl.observability import read_metrics
from tests.e2e.conftest import ASYNC, ASYNC_STEPS, kill9_and_resume, tiny_config
from tests.helpers.warm_workers import warm_workers

STEPS = ASYNC_STEPS
COMPARED = ("rollout/reward/mean", "loss/total", "actor/grad_norm", "rollout/logp_mismatch/max_abs")


def _run(out_dir, *extra, submit_early=True):
    trainer = PipelinedTrainer(tiny_config(out_dir, *STEPS, *extra), submit_early=submit_early, warm=warm_workers())
    try:
        trainer.run()
    finally:
        trainer.close()
    return {r["step"]: r for r in read_metrics(trainer.config.run_dir)}


def test_one_step_off_trains_on_one_version_old_responses(tiny_run):
    # The same torch threads in both runs (the default differs: 1 each when both sides work
    # at once), so step 1 is bit-identical. (The one-step-off run is shared with
    # test_engine_in_driver.py.)
    sync = tiny_run(*STEPS, "rollout.placement=disaggregated", "rollout.tis_cap=2.0", "parallel.cpu_threads=1").rows
    ahead = tiny_run(*STEPS, *ASYNC, "parallel.cpu_threads=1").rows
    assert sorted(ahead) == sorted(sync) == [1, 2, 3, 4, 5]
    for key in COMPARED:
        assert ahead[1][key] == sync[1][key], key
    assert ahead[2]["rollout/reward/mean"] != sync[2]["rollout/reward/mean"]  # generated on older weights
    for step, r in ahead.items():
        expected = 0.0 if step == 1 else 1.0
        assert r["rollout/staleness/max"] == r["rollout/staleness/mean"] == expected, step
        assert r["rollout/weight_version/min"] == max(step - 2, 0), step
        assert r["timing_s/actor_wait_rollout"] >= 0 and r["timing_s/rollout_wait_actor"] >= 0
        assert r["data/position"] == sync[step]["data/position"]  # the same prompts at each step
        assert "timing_s/actor_wait_rollout" not in sync[step] and sync[step]["rollout/staleness/max"] == 0.0
    assert "eval/accuracy/mean" in ahead[3]


def test_early_update_start_and_shared_memory_change_no_number(tmp_path, tiny_run, ray_session):
    early_run = tiny_run(*STEPS, *ASYNC, "parallel.cpu_threads=1")  # submit_early, shared_memory (auto on CPU)
    early = early_run.rows
    assert early_run.transport == "shared_memory"  # auto, on one CPU node
    started_early = [step for step, r in early.items() if r["pipeline/submitted_early"] == 1.0]
    # Steps 2 and 4 save a checkpoint (the next update waits for it) and step 5 is the last;
    # steps 1 and 3 submit the next update once its batch is generated (it is, unless the
    # generation thread had not even begun it when the step synced): steps 2 and 4 may start early.
    assert set(started_early) <= {2, 4} and started_early, started_early
    plain = _run(tmp_path / "plain", *ASYNC, "parallel.cpu_threads=1", "rollout.weight_transport=object_store",
                 submit_early=False)
    assert not any(r["pipeline/submitted_early"] for r in plain.values())
    assert sorted(early) == sorted(plain) == [1, 2, 3, 4, 5]
    for step in early:
        for key in (*COMPARED, "data/position", "rollout/weight_version/min"):
            assert early[step][key] == plain[step][key], (step, key)
    assert early[3]["eval/accuracy/mean"] == plain[3]["eval/accuracy/mean"]  # evaluated while step 4 trained


def test_kill9_with_a_batch_generated_ahead_then_resume(tmp_path):
    # With an evaluation before training (step 0, before generation ahead starts), kept and
    # not repeated by the resumed run.
    args = ("trainer.num_steps=6", "trainer.save_every_steps=2", "trainer.eval_every_steps=6",
            "trainer.eval_before_train=true", *ASYNC)  # fmt: skip
    runs = kill9_and_resume(tmp_path, *args, checkpointed=2, logged=3)  # step 4's batch is queued or in flight
    a, b = runs.uninterrupted, runs.resumed
    assert sorted(b) == list(range(0, 7)), "each step is logged once"
    assert b[0]["eval/accuracy/mean"] == a[0]["eval/accuracy/mean"] and "eval/accuracy/mean" in b[6]
    for step in range(1, 7):
        assert (b[step]["data/epoch"], b[step]["data/position"]) == (a[step]["data/epoch"], a[step]["data/position"])
        assert b[step]["rollout/staleness/max"] <= 1.0
