"""Metrics sink, token-probability diagnostics and plots."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_rl.observability import MetricsSink, read_metrics, token_probability_diagnostics

ROOT = Path(__file__).resolve().parents[2]


def test_diagnostics_hand_computed():
    p_old = torch.tensor([0.1, 0.2, 0.3, 0.55, 0.8, 0.9, 0.05], dtype=torch.float64)
    mask = torch.tensor([1, 1, 1, 1, 1, 1, 0])
    grad = torch.tensor([4.0, 2.0, 1.0, 1.0, 1.0, 1.0, 100.0])  # the masked token must not count
    new = p_old + torch.tensor([0.1, 0.0, 0.2, -0.1, 0.05, 0.05, 0.0], dtype=torch.float64)
    d = token_probability_diagnostics(p_old.log(), mask, logit_grad_norm=grad, new_logp=new.log())
    # buckets: q1 {0.1, 0.2}, q2 {0.3}, q3 {0.55}, q4 {0.8, 0.9}
    assert [d[f"tokens/prob_q{k}/count"] for k in range(1, 5)] == [2, 1, 1, 2]
    assert d["tokens/prob_q1/mean_p"] == pytest.approx(0.15)
    assert d["tokens/prob_q1/grad_share"] == pytest.approx(6 / 10)
    assert d["tokens/prob_q4/grad_share"] == pytest.approx(2 / 10)
    assert sum(d[f"tokens/prob_q{k}/grad_share"] for k in range(1, 5)) == pytest.approx(1.0)
    assert d["tokens/prob_q1/dp_mean"] == pytest.approx(0.05)
    assert d["tokens/prob_q3/dp_mean"] == pytest.approx(-0.1)


def test_bucket_edges_are_lower_inclusive():
    p = torch.tensor([0.25, 0.5, 0.75, 1.0], dtype=torch.float64)
    d = token_probability_diagnostics(p.log(), torch.ones(4))
    assert [d[f"tokens/prob_q{k}/count"] for k in range(1, 5)] == [0, 1, 1, 2]


def test_diagnostics_empty_bucket_and_optional_inputs():
    d = token_probability_diagnostics(torch.tensor([0.9, 0.8]).log(), torch.ones(2))
    assert d["tokens/prob_q1/count"] == 0 and "tokens/prob_q1/mean_p" not in d
    assert "tokens/prob_q4/grad_share" not in d and "tokens/prob_q4/dp_mean" not in d


def test_metrics_sink_jsonl_roundtrip_and_truncate(tmp_path):
    sink = MetricsSink(tmp_path, wandb_mode="disabled")
    for step in (1, 2, 3):
        sink.log(step, {"rollout/reward/mean": step / 10, "loss/bad": float("nan")})
    sink.truncate_after(2)
    sink.log(3, {"rollout/reward/mean": 0.33})
    sink.close()
    recs = read_metrics(tmp_path)
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert recs[2]["rollout/reward/mean"] == 0.33 and recs[0]["loss/bad"] is None
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "rollout/rew')  # a crash mid-line
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]


def test_metrics_sink_wandb_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = MetricsSink(tmp_path, wandb_mode="offline", run_name="t", config={"a": 1})
    sink.log(1, {"rollout/reward/mean": 0.5})
    sink.close()
    assert list((tmp_path / "wandb").glob("offline-run-*"))


def test_plot_run_writes_pngs(tmp_path):
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step in range(1, 6):
            rec = {"step": step, "rollout/reward/mean": math.sin(step), "eval/accuracy/n3/greedy": step / 10,
                   "eval/accuracy/n3/sampled": step / 20}
            rec.update({f"tokens/prob_q{k}/grad_share": 0.25 for k in range(1, 5)})
            f.write(json.dumps(rec) + "\n")
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "plot_run.py"), str(tmp_path)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    for name in ("reward.png", "accuracy.png", "grad_share.png"):
        data = (tmp_path / "plots" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
