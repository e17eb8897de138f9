"""benchmarks/actor_vs_hf.py (the actor's train step against transformers' on the vs-TRL
model) at a toy size: both sides run from the same weights, and their first steps agree
in loss and gradient norm, so the two time the same work."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_both_sides_do_the_same_work():
    cmd = [sys.executable, str(REPO / "benchmarks" / "actor_vs_hf.py"), "--rounds", "1", "--steps", "1",
           "--rows", "4", "--tokens", "12", "--response", "6"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    runs = {d["side"]: d for d in lines if not d.get("summary")}
    (summary,) = [d for d in lines if d.get("summary")]
    assert set(runs) == {"hf", "ours"}
    assert runs["hf"]["first_loss"] != 0.0
    assert abs(runs["ours"]["first_loss"] - runs["hf"]["first_loss"]) <= 1e-6 * abs(runs["hf"]["first_loss"])
    assert summary["first_grad_norm_rel_diff"] < 1e-5, summary
    assert summary["hf_step_s"] > 0 and summary["ours_step_s"] > 0
