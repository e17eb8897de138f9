"""The trainer with real vLLM engines (``examples/tiny_cpu_vllm.yaml``, weights through the
collective gloo transport): log-prob parity with the Megatron actor on every step, kill -9
of the driver then resume reproducing an uninterrupted run, and no process of the run --
the engine's actor, with vLLM's worker in it, and a tensor-parallel engine's worker
processes included -- left behind after an exit or a kill. With a tensor-parallel
engine (``rollout.tensor_parallel_size=2``): colocated, the reward rises and the log-probs
match the actor's; disaggregated, every number equals the colocated run's; nothing is left
behind.

Processes are recognised by an environment tag every process of the run inherits (the
driver's local Ray, its workers, and vLLM's processes below them).
"""

import os
import signal
import statistics
import subprocess
import sys
import time
import uuid

import psutil
import pytest

from megatron_rl.observability import read_metrics
from tests.e2e.conftest import ROOT, tiny_overrides

EXAMPLE = ROOT / "examples" / "tiny_cpu_vllm.yaml"
ARGS = ("trainer.num_steps=6", "trainer.save_every_steps=2", "trainer.eval_every_steps=3")
COMPARED = ("rollout/reward/mean", "loss/total", "actor/grad_norm", "rollout/logp_mismatch/max_abs")


def _tagged(tag):
    """Live (non-zombie) processes whose environment carries ``tag``."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if proc.environ().get("MEGATRON_RL_TEST_RUN") == tag and proc.status() != psutil.STATUS_ZOMBIE:
                found.append((proc.pid, " ".join(proc.info["cmdline"] or [])[:80]))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def _wait_none_tagged(tag, timeout_s):
    deadline = time.monotonic() + timeout_s
    while (left := _tagged(tag)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


START_TIMEOUT = "rollout.pool.restart_timeout_s=1200"
"""Two runs side by side, each starting vLLM's processes (four with a tensor-parallel engine,
~8 CPU-s of imports each), next to another test worker: on a slow shared 2-core CI machine an
engine's start outlasted the default 300 s once (the engine then fails to start; the test
checks what the runs compute, not how fast they start)."""


def _train(out_dir, tag, log=None, args=ARGS):
    cmd = [sys.executable, "-m", "megatron_rl", "train", str(EXAMPLE), *tiny_overrides(out_dir, START_TIMEOUT, *args)]
    env = {**os.environ, "MEGATRON_RL_TEST_RUN": tag}
    out = subprocess.PIPE if log is None else open(log, "w")  # noqa: SIM115  (closed with the process)
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)


def _kill_runs(runs):
    """Kill each ``(process, tag)`` run and every process carrying its tag (a failed test
    must not leave a side-by-side run behind)."""
    for proc, tag in runs:
        if proc.poll() is None:
            proc.kill()
        for pid, _ in _tagged(tag):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_vllm_run_matches_the_actor_resumes_exactly_and_leaves_no_process(tmp_path):
    tag_a, tag_b = uuid.uuid4().hex, uuid.uuid4().hex
    # The uninterrupted run and the one to kill run side by side (separate processes, the
    # same settings: no number changes, the wall time halves).
    ref = _train(tmp_path / "a", tag_a, log=tmp_path / "a.log")
    victim = _train(tmp_path / "b", tag_b, log=tmp_path / "b.log")

    try:
        # kill -9 the driver alone once step 4 is checkpointed and step 5 logged
        run_dir = tmp_path / "b" / "tiny_cpu_vllm"
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if (run_dir / "checkpoints" / "step_000004").is_dir() and (run_dir / "metrics.jsonl").exists():
                if any(r["step"] >= 5 for r in read_metrics(run_dir)):
                    break
            if victim.poll() is not None:
                pytest.fail("the run finished before it could be killed:\n" + (tmp_path / "b.log").read_text()[-4000:])
            time.sleep(0.05)
        # the engine's Ray actor (vLLM's worker runs in it on CPU) is among the processes checked
        assert any("EngineWorker" in cmd or "VLLM::" in cmd for _, cmd in _tagged(tag_b)), _tagged(tag_b)
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait()
        assert not _wait_none_tagged(tag_b, 30), "processes of a killed run are still alive"

        assert ref.wait(timeout=900) == 0, (tmp_path / "a.log").read_text()[-4000:]
        assert not _wait_none_tagged(tag_a, 30), "processes of a finished run are still alive"
        a = {r["step"]: r for r in read_metrics(tmp_path / "a" / "tiny_cpu_vllm")}
        assert sorted(a) == list(range(1, 7))
        for row in a.values():  # vLLM's sampled-token log-probs vs the actor's recomputation
            assert row["rollout/logp_mismatch/max_abs"] <= 1e-4, row["rollout/logp_mismatch/max_abs"]
            assert row["weight_sync/retries"] == 0
    finally:  # a failure above must not leave the side-by-side run behind
        _kill_runs([(ref, tag_a), (victim, tag_b)])

    resumed = _train(tmp_path / "b", tag_b)
    out, _ = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, out[-4000:]
    b = {r["step"]: r for r in read_metrics(run_dir)}
    assert sorted(b) == list(range(1, 7)), "each step is logged once"
    for step in range(1, 7):
        for key in COMPARED:
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-6, abs=1e-6), (step, key)
    assert b[6]["eval/accuracy/mean"] == a[6]["eval/accuracy/mean"]
    assert not _wait_none_tagged(tag_b, 30)


TP2_STEPS, TP2_WINDOW, DISAGGREGATED_STEPS = 60, 15, 10


def test_tensor_parallel_engines_train_colocated_and_disaggregated(tmp_path):
    """Both placements run side by side (separate runs). The colocated run must learn: the
    mean reward of the last 15 of 60 steps beats the first 15 by more than 0.1 and five
    standard errors (measured: a rise of 0.137, 0.01 standard error). The disaggregated run
    (10 steps) must give the same numbers step for step: the placement decides where the
    engine's workers run and when, never what they compute."""
    runs = {}
    try:
        for placement, steps in (("colocated", TP2_STEPS), ("disaggregated", DISAGGREGATED_STEPS)):
            tag = uuid.uuid4().hex
            args = (f"trainer.num_steps={steps}", "trainer.save_every_steps=0", "trainer.save_final=false",
                    "trainer.eval_every_steps=0", "rollout.tensor_parallel_size=2",
                    f"rollout.placement={placement}")  # fmt: skip
            runs[placement] = (_train(tmp_path / placement, tag, log=tmp_path / f"{placement}.log", args=args), tag)
        for placement, (proc, tag) in runs.items():
            assert proc.wait(timeout=1200) == 0, (tmp_path / f"{placement}.log").read_text()[-4000:]
            assert not _wait_none_tagged(tag, 30), f"{placement}: processes of a finished run are still alive"
    finally:
        _kill_runs(runs.values())
    records = read_metrics(tmp_path / "colocated" / "tiny_cpu_vllm")
    assert len(records) == TP2_STEPS
    assert max(r["rollout/logp_mismatch/max_abs"] for r in records) <= 1e-3
    rewards = [r["rollout/reward/mean"] for r in records]
    first, last = rewards[:TP2_WINDOW], rewards[-TP2_WINDOW:]
    rise = statistics.mean(last) - statistics.mean(first)
    noise = (statistics.variance(first) / TP2_WINDOW + statistics.variance(last) / TP2_WINDOW) ** 0.5
    assert rise > max(0.1, 5 * noise), f"rise {rise:.3f}, noise {noise:.3f}, rewards {rewards[::10]}"
    disaggregated = read_metrics(tmp_path / "disaggregated" / "tiny_cpu_vllm")
    assert [r["step"] for r in disaggregated] == list(range(1, DISAGGREGATED_STEPS + 1))
    for got, want in zip(disaggregated, records):
        for key in COMPARED:
            assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-6), (got["step"], key)
