"""``megatron-rl sweep`` end to end on the CPU demo: 2 methods x 2 seeds x 2 steps, each
run a real ``megatron-rl train`` process (two at a time, each with its own Ray cluster),
then the comparison table, JSON and plot."""

import json
import sys

from megatron_rl.observability import read_metrics
from tests.e2e.conftest import EXAMPLE, ROOT, tiny_overrides
from tests.helpers.jobs import run_job

NUM_STEPS = 2


def test_sweep_two_methods_two_seeds(tmp_path):
    out = tmp_path / "sweep"
    overrides = tiny_overrides(tmp_path / "unused", f"trainer.num_steps={NUM_STEPS}", "trainer.eval_every_steps=2",
                               "trainer.eval_before_train=true", "trainer.save_every_steps=0",
                               "trainer.save_final=false")  # fmt: skip
    cmd = [sys.executable, "-m", "megatron_rl", "sweep", str(EXAMPLE), *overrides,
           "--methods", "grpo,ar", "--seeds", "2", "--out", str(out), "--threshold", "0.0", "--jobs", "2"]  # fmt: skip
    proc = run_job(cmd, cwd=ROOT, timeout_s=1200)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    seeds = {}
    for method in ("grpo", "ar"):
        for seed in (1234, 1235):
            run_dir = out / method / f"seed{seed}"
            records = read_metrics(run_dir)
            # step 0: the evaluation before training
            assert [r["step"] for r in records] == list(range(0, NUM_STEPS + 1)), (method, seed)
            seeds[method, seed] = records
    # Both methods start from the same weights at a seed: the same greedy accuracy at step 0.
    for seed in (1234, 1235):
        assert seeds["grpo", seed][0]["eval/accuracy/mean"] == seeds["ar", seed][0]["eval/accuracy/mean"]
    # the runs differ by seed, and the AR run did reweight (its paper alpha, 0.2)
    assert seeds["grpo", 1234][1]["rollout/reward/mean"] != seeds["grpo", 1235][1]["rollout/reward/mean"]
    assert all("loss/ar/weight_mean" in r for r in seeds["ar", 1234][1:])
    assert not any("loss/ar/weight_mean" in r for r in seeds["grpo", 1234])
    config = (out / "ar" / "seed1234" / "config.yaml").read_text()
    assert "alpha: 0.2" in config

    table = (out / "comparison.md").read_text()
    assert "| grpo | 2 |" in table and "| ar | 2 |" in table and table in proc.stdout
    payload = json.loads((out / "comparison.json").read_text())
    assert [m["method"] for m in payload["methods"]] == ["grpo", "ar"]
    for m in payload["methods"]:
        assert len(m["final_accuracy"]["values"]) == 2 and m["num_reached"] == 2  # threshold 0: reached at step 0
        assert m["steps_to_threshold"]["mean"] == 0
        assert 0.0 <= m["low_quartile_grad_share"]["mean"] <= 1.0
        # At random init every token is about as likely as any other (1/15): the regime check.
        assert 0.0 < m["start_q1_mean_p"]["mean"] < 0.2
    assert (out / "comparison.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # a second sweep keeps the finished runs and rewrites the comparison
    again = run_job(cmd, cwd=ROOT, timeout_s=600)
    assert again.returncode == 0 and again.stderr.count("complete, kept") == 4, again.stderr
