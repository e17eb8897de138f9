"""The trainer end to end on the tiny CPU demo: every method's config, NaN steps, bad
inputs, and checkpoint/resume (kill -9 included) reproducing an uninterrupted run."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from megatron_rl.config.run import load_run_config
from megatron_rl.data.loaders import DataError
from megatron_rl.loop.trainer import NonFiniteStepsError, Trainer
from megatron_rl.observability import read_metrics
from tests.e2e.conftest import (
    EXAMPLE,
    LORA_EXAMPLE,
    MOE_EXAMPLE,
    ROOT,
    WARM_BASE,
    assert_adapters_only,
    kill9_and_resume,
    tiny_config,
    tiny_overrides,
)
from tests.helpers.warm_workers import warm_workers

METHOD_KEYS = {
    "grpo": ["loss/ref_kl"],
    "ar": ["loss/ar/weight_mean"],
    "lopti": ["loss/lopti/low_frac"],
    "ar_lopti": ["loss/ar/weight_mean", "loss/lopti/low_frac"],
    "stapo": ["loss/stapo/masked_frac"],
    "tr_grpo": ["loss/tr_grpo/weight_mean"],
}


def run(cfg):
    trainer = Trainer(cfg, warm=warm_workers())
    try:
        return trainer.run(), trainer
    finally:
        trainer.close()


@pytest.mark.parametrize("method", list(METHOD_KEYS))
def test_each_paper_method_config_runs_two_steps(method, tmp_path, ray_session):
    """The ``algorithm`` section of examples/kk_logic/<method>_3b.yaml on the tiny model."""
    with open(ROOT / "examples" / "kk_logic" / f"{method}_3b.yaml") as f:
        algorithm = yaml.safe_load(f)["algorithm"]
    cfg = tiny_config(tmp_path, "trainer.num_steps=2", "trainer.eval_every_steps=0", "trainer.save_every_steps=0")
    from megatron_rl.algo.config import AlgorithmConfig
    from megatron_rl.config.lib import from_dict

    cfg.algorithm = from_dict(AlgorithmConfig, algorithm, "algorithm")
    last, _ = run(cfg)
    passes = 2 if cfg.algorithm.lopti.enabled else 1
    assert last["actor/updates"] == passes * cfg.trainer.num_minibatches_per_step
    for key in METHOD_KEYS[method]:
        assert key in last, (key, sorted(last))
    assert torch.isfinite(torch.tensor(last["loss/total"]))
    records = read_metrics(cfg.run_dir)
    assert [r["step"] for r in records] == [1, 2]
    assert (cfg.run_dir / "checkpoints" / "step_000002").is_dir()


def nan_advantages_at(monkeypatch, *steps: int) -> None:
    """NaN advantages at RL steps ``steps`` (the loop computes one step's advantages per call)."""
    from megatron_rl.loop import step as step_module

    compute = step_module.compute_advantages
    calls = []

    def nan_at(rewards, group_index, config):
        calls.append(None)
        adv = compute(rewards, group_index, config)
        return adv * float("nan") if len(calls) in steps else adv

    monkeypatch.setattr(step_module, "compute_advantages", nan_at)


def test_nan_step_is_skipped_and_counted(tmp_path, ray_session, monkeypatch):
    cfg = tiny_config(tmp_path, "trainer.num_steps=3", "trainer.eval_every_steps=0", "trainer.save_every_steps=0",
                      "trainer.save_final=false")  # fmt: skip
    nan_advantages_at(monkeypatch, 2)
    run(cfg)
    assert not any((cfg.run_dir / "checkpoints").glob("step_*"))  # save_final=false: no checkpoint at all
    rec = {r["step"]: r for r in read_metrics(cfg.run_dir)}
    assert rec[1]["actor/step_skipped"] == 0 and rec[3]["actor/step_skipped"] == 0
    assert rec[2]["actor/step_skipped"] == 1 and rec[2]["actor/skipped_steps_total"] == 1
    assert rec[3]["actor/optimizer_steps_total"] == 2  # steps 1 and 3 updated


def test_consecutive_nonfinite_steps_stop_with_last_good_checkpoint(tmp_path, ray_session, monkeypatch):
    cfg = tiny_config(
        tmp_path, "trainer.num_steps=5", "trainer.eval_every_steps=0", "trainer.save_every_steps=1",
        "trainer.max_consecutive_nonfinite_steps=2",
    )  # fmt: skip
    nan_advantages_at(monkeypatch, 2, 3)
    with pytest.raises(NonFiniteStepsError, match="2 consecutive steps"):
        run(cfg)
    ckpts = cfg.run_dir / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_000001"
    assert sorted(p.name for p in ckpts.iterdir() if p.is_dir()) == ["step_000001"]
    records = read_metrics(cfg.run_dir)  # the step that stopped the run is logged too
    assert [r["step"] for r in records] == [1, 2, 3] and records[-1]["actor/step_skipped"] == 1.0


def test_bad_data_row_is_named_and_nothing_is_written(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "copy 1 2 3 =", "ground_truth": "1 2 3"}\n{"prompt": "copy 4 5 6 ="}\n')
    cfg = tiny_config(tmp_path / "out", f"data.train_files=[{bad}]")
    with pytest.raises(DataError) as err:
        Trainer(cfg)
    assert str(bad) in str(err.value) and "row 2" in str(err.value) and "ground_truth" in str(err.value)
    assert not (tmp_path / "out").exists()


def test_bad_reward_function_and_config_exit_2_without_a_checkpoint(tmp_path):
    for override, needle in (
        ("data.reward=no_such_module:score", "no_such_module"),
        ("trainer.lr=-1", "trainer.lr"),
        ("algorithm.stapo.tau_p=7", "algorithm.stapo.tau_p"),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "megatron_rl", "train", str(EXAMPLE), *tiny_overrides(tmp_path), override],
            capture_output=True, text=True, cwd=ROOT,
        )  # fmt: skip
        assert proc.returncode == 2, proc.stderr
        assert needle in proc.stderr
    assert not list(tmp_path.rglob("step_*"))


COMPARED = ("rollout/reward/mean", "loss/total", "actor/grad_norm", "loss/approx_kl", "tokens/quartile_q1/grad_share")


def test_kill9_then_resume_matches_an_uninterrupted_run(tmp_path):
    """examples/tiny_cpu_moe.yaml with its experts over two ranks (expert-parallel optimizer
    state and checkpoint shards, the router's load-balancing loss), killed between two
    checkpoints: the rerun resumes from the last, logs each step once and matches an
    uninterrupted run. (The dense demo's kill -9 resumes: tests/e2e/test_async_rollout.py
    with a batch generated ahead, tests/vllm/test_vllm_trainer.py with vLLM.)"""
    args = ("trainer.num_steps=8", "trainer.save_every_steps=2", "trainer.eval_every_steps=4",
            "parallel.num_actor_ranks=2", "parallel.expert_model_parallel_size=2")  # fmt: skip
    runs = kill9_and_resume(tmp_path, *args, checkpointed=4, logged=5, example=MOE_EXAMPLE)  # mid-way to step 6's save
    assert runs.latest_after_kill in ("step_000004", "step_000006")
    a, b, run_dir = runs.uninterrupted, runs.resumed, runs.run_dir
    assert sorted(b) == list(range(1, 9)), "each step is logged once (lines after the checkpoint dropped)"
    for step in range(1, 9):
        for key in (*COMPARED, "moe/load_balancing_loss", "loss/moe_aux"):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-6, abs=1e-7), (step, key)
    assert b[8]["eval/accuracy/mean"] == a[8]["eval/accuracy/mean"]
    cfg_saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert cfg_saved["trainer"]["num_steps"] == 8
    assert cfg_saved["parallel"]["expert_model_parallel_size"] == 2
    json.dumps(b[8])  # metrics are plain JSON


def test_lora_kill9_then_resume_matches_an_uninterrupted_run(tiny_run, tmp_path):
    """examples/tiny_cpu_lora.yaml over the demo's step-100 checkpoint: its checkpoints hold
    the adapters and their optimizer state only and name that base; killed between two of
    them, the rerun loads the base, then the adapters, logs each step once and matches an
    uninterrupted run."""
    base = tiny_run(*WARM_BASE).run_dir / "checkpoints" / "step_000100"
    args = ("trainer.num_steps=6", "trainer.save_every_steps=2", "trainer.eval_every_steps=3",
            f"model.checkpoint={base}")  # fmt: skip
    runs = kill9_and_resume(tmp_path, *args, checkpointed=2, logged=3, example=LORA_EXAMPLE)  # mid-way to step 4's save
    assert runs.latest_after_kill in ("step_000002", "step_000004")
    a, b = runs.uninterrupted, runs.resumed
    assert sorted(b) == list(range(1, 7)), "each step is logged once (lines after the checkpoint dropped)"
    for step in range(1, 7):
        for key in COMPARED:
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-6, abs=1e-7), (step, key)
    assert b[6]["eval/accuracy/mean"] == a[6]["eval/accuracy/mean"]
    saved = runs.run_dir / "checkpoints" / "step_000006"
    assert_adapters_only(saved, base)


def test_resume_never_refuses_to_overwrite(tmp_path, ray_session):
    cfg = tiny_config(tmp_path, "trainer.num_steps=1", "trainer.eval_every_steps=0")
    run(cfg)
    again = load_run_config(EXAMPLE, tiny_overrides(tmp_path, "trainer.num_steps=1", "trainer.resume=never"))
    with pytest.raises(FileExistsError, match="already holds checkpoints"):
        Trainer(again)
    assert Path(cfg.run_dir / "checkpoints" / "latest").exists()
