"""``megatron-rl sft`` end to end on the toy copy task (examples/tiny_cpu_sft.yaml): the
loss falls and the eval rows' likelihood rises; the checkpoint is an RL run's
``model.checkpoint`` (the reference policy is the SFT weights: KL 0 at step 1, and the
greedy reward far above a random init's); a run killed between checkpoints resumes and
matches an uninterrupted one. The loss itself against a float64 reference, at every
layout: tests/unit/test_sft_loss.py, tests/distributed/test_actor.py."""

from __future__ import annotations

import math

import pytest

from tests.e2e.conftest import SFT_EXAMPLE, kill9_and_resume, tiny_config, train_sft_in_process

SFT_STEPS = ("trainer.num_steps=60", "trainer.save_every_steps=60", "trainer.eval_every_steps=20")


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory, ray_session):
    """The example's 60 steps, in this process (the e2e tier's Ray cluster)."""
    config = tiny_config(tmp_path_factory.mktemp("sft"), *SFT_STEPS, example=SFT_EXAMPLE, command="sft")
    return {r["step"]: r for r in train_sft_in_process(config)}, config.run_dir


def test_sft_loss_falls_and_the_eval_likelihood_rises(sft_run):
    rows, _ = sft_run
    assert sorted(rows) == list(range(1, 61))
    first = sum(rows[s]["loss/total"] for s in range(1, 6)) / 5
    last = sum(rows[s]["loss/total"] for s in range(56, 61)) / 5
    print(f"SFT loss {first:.3f} -> {last:.3f}; eval NLL", [round(rows[s]["eval/nll"], 3) for s in (20, 40, 60)])
    assert abs(first - math.log(15)) < 0.3, "a random init's loss is about ln(vocabulary) = 2.71"
    assert last < first - 1.0
    nll = [rows[s]["eval/nll"] for s in (20, 40, 60)]
    assert nll[0] > nll[1] > nll[2]
    # 64 eval rows x (3 digits + <eos>): every response token counted, each step's rows trained on
    assert rows[20]["eval/response_tokens"] == 64 * 4 and rows[1]["sft/response_tokens"] == 32 * 4
    assert all(rows[s]["actor/step_skipped"] == 0.0 for s in rows)


def test_an_rl_run_starts_from_the_sft_checkpoint(sft_run, tiny_run):
    _, run_dir = sft_run
    checkpoint = run_dir / "checkpoints" / "step_000060"
    rl = tiny_run("trainer.num_steps=1", "trainer.eval_every_steps=1", "trainer.save_every_steps=0",
                  "trainer.save_final=false", "algorithm.kl_coef=0.01", "logging.token_diagnostics=false",
                  "model.init=pretrained", f"model.checkpoint={checkpoint}").rows[1]  # fmt: skip
    random_init = tiny_run("trainer.num_steps=1", "trainer.eval_every_steps=1", "trainer.save_every_steps=0",
                           "trainer.save_final=false", "algorithm.kl_coef=0.01",
                           "logging.token_diagnostics=false").rows[1]  # fmt: skip
    print("greedy eval reward: after SFT", rl["eval/reward/mean/greedy"], "random init",
          random_init["eval/reward/mean/greedy"])
    # The reference policy is the SFT weights, as is the policy before its first update.
    assert rl["loss/ref_kl"] == 0.0 and rl["rollout/logp_mismatch/max_abs"] < 1e-5
    assert rl["eval/reward/mean/greedy"] > random_init["eval/reward/mean/greedy"] + 0.3
    assert rl["loss/entropy"] < random_init["loss/entropy"] - 0.3


def test_sft_kill9_then_resume_matches_an_uninterrupted_run(tmp_path):
    args = ("trainer.num_steps=6", "trainer.save_every_steps=2", "trainer.eval_every_steps=3",
            "trainer.eval_before_train=true")  # fmt: skip
    runs = kill9_and_resume(tmp_path, *args, checkpointed=2, logged=3, example=SFT_EXAMPLE, command="sft")
    assert runs.latest_after_kill in ("step_000002", "step_000004")
    a, b = runs.uninterrupted, runs.resumed
    # Each step is logged once (lines after the checkpoint dropped); the evaluation before
    # training (step 0) is kept, not repeated, by the resumed run.
    assert sorted(b) == list(range(0, 7))
    assert b[0]["eval/nll"] == pytest.approx(a[0]["eval/nll"], rel=1e-6) and b[0]["eval/nll"] > b[6]["eval/nll"]
    for step in range(1, 7):
        for key in ("loss/total", "actor/grad_norm", "sft/response_tokens"):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-6, abs=1e-7), (step, key)
    assert b[6]["eval/nll"] == pytest.approx(a[6]["eval/nll"], rel=1e-6)
