"""benchmarks/gpu_suite.py: the one-call GPU suite, run at toy sizes on the CPU (``--tiny``).

The full-size suite needs a GPU (docs/gpu.md); here every case runs end to end on a
world-1 gloo group in a subprocess, and the checks are on what it wrote: one result line
per case with finite numbers, the fused loss agreeing with megatron's cross-entropy +
entropy baseline, and the float32 actor's log-probs agreeing with a float64
``transformers`` forward (a tolerance the suite can fail). The bookkeeping (a failing
case recorded without losing the others, the time limit, case selection, the table) is
checked in-process.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SUITE = REPO / "benchmarks" / "gpu_suite.py"


def _module():
    if "gpu_suite" not in sys.modules:  # registered first: its dataclasses look their module up
        spec = importlib.util.spec_from_file_location("gpu_suite", SUITE)
        module = importlib.util.module_from_spec(spec)
        sys.modules["gpu_suite"] = module
        spec.loader.exec_module(module)
    return sys.modules["gpu_suite"]


def _numbers(value, path=""):
    """Every number in a record (recursively), with its path; strings the suite wrote for
    non-finite floats count as numbers too."""
    if isinstance(value, dict):
        for k, v in value.items():
            if k not in ("table", "traceback"):
                yield from _numbers(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _numbers(v, f"{path}[{i}]")
    elif isinstance(value, bool):
        return
    elif isinstance(value, (int, float)):
        yield path, float(value)
    elif isinstance(value, str) and value.lower() in ("nan", "inf", "-inf"):
        yield path, float(value)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_suite")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(SUITE), "--tiny", "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    records = [json.loads(line) for line in (out / "gpu_suite.jsonl").read_text().splitlines()]
    stdout_records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert stdout_records == records  # the same lines on stdout and in the file
    return records, (out / "gpu_suite.md").read_text(), seconds


def test_every_case_reports_finite_numbers(tiny_run):
    records, _, seconds = tiny_run
    mod = _module()
    by_case = {}
    for rec in records:
        by_case.setdefault(rec["case"], []).append(rec)
        assert rec["device"] == "cpu" and rec["tiny"] is True and rec["torch"]
        assert rec["status"] in ("ok", "skipped"), rec
        bad = [(p, v) for p, v in _numbers(rec) if not math.isfinite(v)]
        assert not bad, (rec["case"], rec["variant"], bad)
    assert set(by_case) == {"calibration", "summary", *mod.CASES}
    for case in mod.CASES:
        assert any(r["status"] == "ok" for r in by_case[case]), case

    calib = by_case["calibration"][0]
    assert calib["copy_gb_per_s"] > 0 and calib["gemm_tflops"] > 0
    loss = {r["method"]: r for r in by_case["loss"] if r.get("method") and r["tokens"] == 256}
    assert set(loss) == {"fused", "fused[torch kernel]", "megatron_ce+entropy"}
    for rec in loss.values():
        assert rec["fwd_bwd_s"] > 0 and rec["x_floor"] > 0 and rec["floor_bytes"] == 256 * 1000 * 4
    agreement = next(r for r in by_case["loss"] if r["variant"].startswith("agreement"))
    assert agreement["loss_rel_diff"] < 1e-4  # both compute in float32 from the same bf16 logits
    assert agreement["grad_max_abs_diff"] <= 0.02 * agreement["grad_max_abs"]  # bf16 gradients
    assert agreement["kernel"] == "torch"  # "auto" on a CPU: the chunked torch ops
    assert agreement["grad_max_abs_diff_vs_torch_kernel"] <= 0.02 * agreement["grad_max_abs"]
    linear = {r["method"] for r in by_case["linear"] if r["status"] == "ok"}
    assert linear == {"fused_linear", "fused_linear[torch kernel]", "unfused (hidden @ W^T, fused loss)"}
    actor = next(r for r in by_case["actor"] if r["spec"] == "local")
    assert actor["tokens_per_s"] > 0 and actor["mfu_vs_measured_gemm"] > 0 and actor["step_skipped"] == 0
    lora = next(r for r in by_case["actor"] if r.get("spec") == "lora")  # rank-16 adapters: a small share trains
    assert lora["status"] == "ok" and lora["step_skipped"] == 0 and 0 < lora["trainable_params"] < actor["params"] / 4
    assert actor["trainable_params"] >= actor["params"]
    te = next(r for r in by_case["actor"] if r["variant"] == "te spec")
    assert te["status"] == "skipped" and te["reason"]
    engine = by_case["engine"][0]
    assert engine["generated_tokens"] == engine["prompts"] * engine["samples"] * engine["max_new_tokens"]
    assert engine["tokens_per_s"] > 0
    gemms = next(r for r in by_case["moe"] if r["variant"] == "expert gemms")
    assert gemms["status"] == "ok", gemms  # torch's grouped_mm takes bf16 on a CPU too
    assert all(v <= 1e-2 for v in gemms["max_rel_diff"].values()), gemms["max_rel_diff"]
    moe_actor = next(r for r in by_case["moe"] if r["variant"] == "actor step")
    assert moe_actor["tokens_per_s"] > 0 and 0 < moe_actor["active_params"] < moe_actor["params"]
    assert moe_actor["load_balancing_loss"] > 0
    summary = by_case["summary"][0]
    assert summary["failed_cases"] == [] and not {"ray", "vllm"} & set(summary["imported_heavy_modules"])
    print(f"tiny suite: {seconds:.1f} s")


def test_float32_actor_logprobs_match_a_float64_reference(tiny_run):
    records, _, _ = tiny_run
    lp = {r["actor_dtype"]: r for r in records if r["case"] == "logprob"}
    assert set(lp) == {"float32", "bfloat16"}
    fp32, bf16 = lp["float32"], lp["bfloat16"]
    # Not a near-uniform model: the reference's entropy is well below log(V) = 6.9 nats.
    assert 0.5 < fp32["ref_entropy_mean"] < 6.0
    assert fp32["max_abs_dlogp"] < 1e-3 and fp32["max_abs_dentropy"] < 1e-3
    assert fp32["mean_abs_dlogp"] < 1e-4
    assert bf16["max_abs_dlogp"] < 0.5 and bf16["mean_abs_dlogp"] < 0.1
    assert bf16["mean_abs_dlogp"] > fp32["mean_abs_dlogp"]  # bf16 really ran in bf16


def test_markdown_table_has_a_section_per_case(tiny_run):
    _, md, _ = tiny_run
    mod = _module()
    for case in mod.CASES:
        assert mod.CASE_TITLES[case] in md
    assert "| fused T=256 | fused | 256 |" in md
    assert "failed cases: none" in md


# ----------------------------------------------------------------------------- in-process bookkeeping


def _suite(mod, tmp_path, budget_s=60.0):
    args = argparse.Namespace(out=str(tmp_path), tiny=True, budget_s=budget_s, backend=None)
    return mod.Suite(args, mod.tiny_sizes(), "cpu")


def test_a_failing_case_is_recorded_and_the_next_one_still_runs(tmp_path, monkeypatch):
    mod = _module()
    suite = _suite(mod, tmp_path)

    def broken(s):
        s.emit("loss", "fused T=1", fwd_bwd_s=0.5, table={"fwd+bwd ms": "500"})
        raise ValueError("boom")

    monkeypatch.setitem(mod.CASE_FNS, "loss", broken)
    monkeypatch.setitem(mod.CASE_FNS, "linear", lambda s: s.emit("linear", "x", fwd_bwd_s=1.0))
    try:
        mod._run_case(suite, "loss", ["linear"])
        mod._run_case(suite, "linear", [])
    finally:
        suite.close()
    assert suite.failed == ["loss"]
    lines = [json.loads(x) for x in (tmp_path / "gpu_suite.jsonl").read_text().splitlines()]
    assert [(r["case"], r["status"]) for r in lines] == [("loss", "ok"), ("loss", "failed"), ("linear", "ok")]
    assert "ValueError: boom" in lines[1]["error"] and "Traceback" in lines[1]["traceback"]
    md = (tmp_path / "gpu_suite.md").read_text()
    assert "failed: ValueError: boom" in md and "| fused T=1 |" in md


def test_a_case_past_its_share_of_the_budget_is_interrupted(tmp_path, monkeypatch):
    mod = _module()
    suite = _suite(mod, tmp_path, budget_s=1.5)
    suite.sizes.reserve_s = {c: 0 for c in mod.CASES}
    monkeypatch.setitem(mod.CASE_FNS, "engine", lambda s: time.sleep(30))
    start = time.perf_counter()
    try:
        mod._run_case(suite, "engine", [])
        mod._run_case(suite, "logprob", [])  # nothing left: skipped, not run
    finally:
        suite.close()
    assert time.perf_counter() - start < 10
    assert [(r["case"], r["status"]) for r in suite.records] == [("engine", "failed"), ("logprob", "skipped")]
    assert "CaseTimeout" in suite.records[0]["error"] and "time budget" in suite.records[1]["reason"]


def test_case_selection():
    mod = _module()
    assert mod.parse_cases(None) == list(mod.CASES)
    assert mod.parse_cases(["logprob,loss"]) == ["loss", "logprob"]  # always in suite order
    assert mod.parse_cases(["3", "engine"]) == ["actor", "engine"]
    with pytest.raises(SystemExit, match="unknown case"):
        mod.parse_cases(["nope"])


def test_full_size_run_refuses_without_a_gpu(capsys):
    mod = _module()
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert mod.main(["--cases", "loss"]) == 2
    assert "--tiny" in capsys.readouterr().err
