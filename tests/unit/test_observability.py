"""Metrics sink, token-probability diagnostics and plots."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_rl.observability import (
    BUCKET_GROUPS,
    QUARTILE_GROUPS,
    MetricsSink,
    quartile_index,
    read_metrics,
    token_probability_diagnostics,
)
from megatron_rl.observability.plots import binned_means, binned_shares

ROOT = Path(__file__).resolve().parents[2]
Q = [g.prefix for g in QUARTILE_GROUPS]
B = [g.prefix for g in BUCKET_GROUPS]


def test_group_names_say_what_they_hold():
    assert Q == [f"tokens/quartile_q{k}" for k in range(1, 5)]
    assert B == ["tokens/bucket_p000_025", "tokens/bucket_p025_050", "tokens/bucket_p050_075", "tokens/bucket_p075_100"]


def test_diagnostics_hand_computed():
    p_old = torch.tensor([0.1, 0.2, 0.3, 0.55, 0.8, 0.9, 0.05, 0.6], dtype=torch.float64)
    mask = torch.tensor([1, 1, 1, 1, 1, 1, 0, 1])
    grad = torch.tensor([4.0, 2.0, 1.0, 1.0, 1.0, 1.0, 100.0, 0.0])  # the masked token must not count
    new = p_old + torch.tensor([0.1, 0.0, 0.2, -0.1, 0.05, 0.05, 0.0, -0.2], dtype=torch.float64)
    d = token_probability_diagnostics(p_old.log(), mask, logit_grad_norm=grad, new_logp=new.log())
    assert d["tokens/count"] == 7 and d["tokens/logit_grad_norm_sum"] == pytest.approx(10.0)
    # fixed buckets: [0,.25) {0.1, 0.2}, [.25,.5) {0.3}, [.5,.75) {0.55, 0.6}, [.75,1] {0.8, 0.9}
    assert [d[f"{b}/count"] for b in B] == [2, 1, 2, 2]
    assert d[f"{B[0]}/mean_p"] == pytest.approx(0.15)
    assert [d[f"{b}/grad_share"] for b in B] == pytest.approx([0.6, 0.1, 0.1, 0.2])
    assert d[f"{B[2]}/dp_mean"] == pytest.approx(-0.15)
    # quartiles of the 7 valid tokens by rank: sizes 2, 2, 2, 1 (floor(4 * rank / 7))
    # sorted: 0.1 0.2 | 0.3 0.55 | 0.6 0.8 | 0.9
    assert [d[f"{q}/count"] for q in Q] == [2, 2, 2, 1]
    assert [d[f"{q}/mean_p"] for q in Q] == pytest.approx([0.15, 0.425, 0.7, 0.9])
    assert [d[f"{q}/p_max"] for q in Q] == pytest.approx([0.2, 0.55, 0.8, 0.9])
    assert [d[f"{q}/grad_share"] for q in Q] == pytest.approx([0.6, 0.2, 0.1, 0.1])
    assert [d[f"{q}/dp_mean"] for q in Q] == pytest.approx([0.05, 0.05, -0.075, 0.05])


def test_bucket_edges_are_lower_inclusive():
    p = torch.tensor([0.25, 0.5, 0.75, 1.0], dtype=torch.float64)
    d = token_probability_diagnostics(p.log(), torch.ones(4))
    assert [d[f"{b}/count"] for b in B] == [0, 1, 1, 2]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 100, 1001, 4099])
def test_quartiles_are_equal_count_on_random_probabilities(n):
    gen = torch.Generator().manual_seed(n)
    # skewed like a trained policy's probabilities, with ties
    p = torch.rand(n, generator=gen, dtype=torch.float64) ** 4
    p[: n // 3] = p[0]
    q = quartile_index(p)
    counts = torch.bincount(q, minlength=4)
    assert int(counts.sum()) == n and int(counts.max() - counts.min()) <= 1
    # by rank: every value of a lower quartile is <= every value of a higher one
    for k in range(3):
        lo, hi = p[q == k], p[q > k]
        if lo.numel() and hi.numel():
            assert float(lo.max()) <= float(hi.min())
    d = token_probability_diagnostics(p.log(), torch.ones(n))
    assert [d[f"{g}/count"] for g in Q] == counts.tolist()


def test_every_group_present_when_empty_and_shares_zero_without_gradient():
    d = token_probability_diagnostics(
        torch.tensor([0.9, 0.8]).log(), torch.ones(2), logit_grad_norm=torch.zeros(2), new_logp=torch.zeros(2)
    )
    for prefix in Q + B:
        for field in ("count", "mean_p", "grad_share", "dp_mean"):
            assert f"{prefix}/{field}" in d, (prefix, field)
    assert [d[f"{b}/count"] for b in B] == [0, 0, 0, 2]
    assert d[f"{B[0]}/mean_p"] == 0.0 and d[f"{B[0]}/dp_mean"] == 0.0  # placeholders for an empty group
    assert [d[f"{q}/count"] for q in Q] == [1, 0, 1, 0]  # n = 2: ranks 0, 1 -> quartiles 0, 2
    assert all(d[f"{g}/grad_share"] == 0.0 for g in Q + B)  # no gradient at all this step
    # the optional inputs: no shares, no dp
    d = token_probability_diagnostics(torch.tensor([0.9, 0.8]).log(), torch.ones(2))
    assert "tokens/logit_grad_norm_sum" not in d and f"{Q[0]}/grad_share" not in d and f"{Q[0]}/dp_mean" not in d


def _record(step, shares, counts, dp=None, total=1.0):
    rec = {"step": step, "tokens/logit_grad_norm_sum": total}
    for prefix, s, c in zip(B, shares, counts):
        rec.update({f"{prefix}/grad_share": s, f"{prefix}/count": c, f"{prefix}/mean_p": 0.0})
        if dp is not None:
            rec[f"{prefix}/dp_mean"] = dp
    return rec


def test_binned_shares_gap_for_missing_groups_and_sum_to_one():
    records = [
        _record(1, [0.9, 0.1, 0.0, 0.0], [10, 5, 0, 0]),
        _record(2, [0.5, 0.5, 0.0, 0.0], [10, 5, 0, 0]),
        _record(3, [0.0, 0.2, 0.8, 0.0], [0, 5, 10, 0]),  # the lowest bucket has emptied
        _record(4, [0.0, 0.0, 0.4, 0.6], [0, 0, 10, 10]),
        _record(5, [0.0] * 4, [0, 0, 10, 10], total=0.0),  # no gradient: left out
        {"step": 6, "rollout/reward/mean": 1.0},  # no diagnostics logged: left out
    ]
    x, rows = binned_shares(records, BUCKET_GROUPS, width=2)
    assert x == [1.5, 3.5]
    assert rows[0][:2] == pytest.approx([0.7, 0.3]) and all(math.isnan(v) for v in rows[0][2:])
    # bin 2: the lowest bucket is a gap, not its stale 0.7; the middle ones average true zeros in
    assert math.isnan(rows[1][0]) and rows[1][1:] == pytest.approx([0.1, 0.6, 0.3])
    for row in rows:
        assert sum(v for v in row if not math.isnan(v)) == pytest.approx(1.0)
    # per step (width 1): never a value for a group with no tokens
    x, rows = binned_shares(records, BUCKET_GROUPS, width=1)
    assert x == [1, 2, 3, 4] and math.isnan(rows[2][0]) and math.isnan(rows[3][1])


def test_binned_means_are_token_weighted_and_gap_when_empty():
    records = [_record(1, [1, 0, 0, 0], [1, 3, 0, 0], dp=0.2), _record(2, [1, 0, 0, 0], [3, 0, 0, 0], dp=0.1)]
    records[1][f"{B[0]}/dp_mean"] = -0.1
    x, rows = binned_means(records, BUCKET_GROUPS, "dp_mean", width=2)
    assert rows[0][0] == pytest.approx((1 * 0.2 + 3 * -0.1) / 4)
    assert rows[0][1] == pytest.approx(0.2) and math.isnan(rows[0][2]) and math.isnan(rows[0][3])


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


def test_truncate_keeps_the_evaluation_before_training_on_resume_and_drops_it_on_a_fresh_start(tmp_path):
    sink = MetricsSink(tmp_path, wandb_mode="disabled")
    for step in (0, 1, 2, 3):  # step 0: trainer.eval_before_train's line
        sink.log(step, {"eval/accuracy/mean": step / 10})
    sink.truncate_after(2)  # resumed from step 2's checkpoint
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2]
    sink.truncate_after(0)  # a fresh start: every line is a dead run's
    sink.close()
    assert read_metrics(tmp_path) == []


def test_metrics_sink_wandb_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = MetricsSink(tmp_path, wandb_mode="offline", run_name="t", config={"a": 1})
    sink.log(1, {"rollout/reward/mean": 0.5})
    sink.close()
    assert list((tmp_path / "wandb").glob("offline-run-*"))


def test_plot_run_writes_pngs_from_real_diagnostics(tmp_path):
    gen = torch.Generator().manual_seed(0)
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step in range(1, 31):
            # the policy sharpens: late steps have no low-probability tokens at all
            p = (torch.rand(64, generator=gen, dtype=torch.float64) * (1 - step / 31) + step / 31).clamp(max=1)
            rec = {"step": step, "rollout/reward/mean": math.sin(step), "eval/accuracy/n3/greedy": step / 40,
                   "eval/accuracy/n3/sampled": step / 50}  # fmt: skip
            rec.update(token_probability_diagnostics(p.log(), torch.ones(64), logit_grad_norm=1 - p,
                                                     new_logp=(p * 0.99).log()))  # fmt: skip
            f.write(json.dumps(rec) + "\n")
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "plot_run.py"), str(tmp_path)],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    for name in ("reward.png", "accuracy.png", "grad_share.png", "token_quartiles.png"):
        data = (tmp_path / "plots" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    records = read_metrics(tmp_path)
    _, rows = binned_shares(records, BUCKET_GROUPS, width=5)
    assert math.isnan(rows[-1][0]), "the p < .25 bucket is empty at the end: a gap, not a stale share"


def test_run_logging_keeps_the_projects_warnings_on_screen_and_every_notice_in_the_file(tmp_path):
    """observability.run_log in a fresh process: a warning of the project (its own class, or
    raised from its files) reaches stderr and the log file; a library's warning and a
    library logger's notice reach the file only; any error reaches both."""
    import subprocess
    import sys

    log = tmp_path / "logs" / "driver.log"
    code = f"""
import logging, warnings
from megatron_rl.observability.run_log import setup_process_logging
from megatron_rl.config.lib.errors import ConfigWarning
setup_process_logging({str(log)!r})
warnings.warn(ConfigWarning("x", "ours: a config warning"))
warnings.warn("theirs: Apex is not installed", UserWarning)
logging.getLogger("ray._private.worker").warning("theirs: token notice")
logging.getLogger("ray").error("theirs: an error")
logging.getLogger("megatron_rl.pool").warning("ours: a pool warning")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    screen, text = proc.stderr, log.read_text()
    for line in ("ours: a config warning", "ours: a pool warning", "theirs: an error"):
        assert line in screen and line in text, line
    for line in ("theirs: Apex is not installed", "theirs: token notice"):
        assert line not in screen and line in text, line


def test_a_workers_library_errors_stay_in_its_file(tmp_path):
    """A Ray worker's log (``setup_worker_logging``): the project's warnings reach stderr, a
    library's error only the file (the failure reaches the driver as the call's exception)."""
    import os
    import subprocess
    import sys

    from megatron_rl.observability.run_log import LOG_DIR_ENV

    code = """
import logging
from megatron_rl.observability.run_log import setup_worker_logging
setup_worker_logging()
logging.getLogger("megatron.core.dist_checkpointing").error("theirs: no space left")
logging.getLogger("megatron_rl.actor").warning("ours: a warning")
"""
    env = {**os.environ, LOG_DIR_ENV: str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    (log,) = tmp_path.glob("worker-*.log")
    assert "ours: a warning" in proc.stderr and "ours: a warning" in log.read_text()
    assert "theirs: no space left" not in proc.stderr and "theirs: no space left" in log.read_text()
