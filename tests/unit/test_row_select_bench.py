"""benchmarks/row_select.py (the fused lm-head with and without its loss-token row
selection) at toy sizes on the CPU: it runs end to end, prints a line for every fraction,
method and mode, and the two paths agree (float32, so to rounding)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_row_select_runs_and_both_paths_agree():
    cmd = [sys.executable, str(REPO / "benchmarks" / "row_select.py"), "--device", "cpu", "--dtype", "float32",
           "--tokens", "256", "--vocab", "512", "--hidden", "32", "--repeats", "1", "--queue-ms", "1",
           "--fractions", "0.25", "0.75"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    agreement = [d for d in lines if d["method"] == "agreement"]
    assert [d["fraction"] for d in agreement] == [0.25, 0.75]
    for d in agreement:
        assert d["loss_rel_diff"] < 1e-5 and d["hidden_grad_max_diff"] < 1e-4, d
        assert d["weight_grad_max_diff"] < 1e-4 * max(1.0, d["weight_grad_max"]), d
    timed = {(d["fraction"], d["method"], d["mode"]) for d in lines if d["method"] != "agreement"}
    assert timed == {(f, m, q) for f in (0.25, 0.75) for m in ("all", "selected") for q in ("alone", "queued")}
    # 256 tokens in sequences of 256 whose first (1 - fraction) are prompt.
    assert {d["loss_tokens"] for d in lines if d["fraction"] == 0.25 and "loss_tokens" in d} == {64}
