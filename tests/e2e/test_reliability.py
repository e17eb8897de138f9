"""Issue 17 end to end on the tiny CPU demo, through the real ``megatron-rl train``:

* an over-long prompt at row 400 fails in seconds, before Ray starts, naming the row;
* a driver killed with SIGKILL before its first checkpoint leaves no process behind (the
  process table is walked by the run's PIDs), and the rerun logs every step once;
* resuming falls back past every kind of corruption of the latest checkpoint, naming it
  (one trained run shared by all cases; the choice is the pre-flight's, so each case is
  a dry run), and a real resume from the previous checkpoint works while a crafted
  pickle planted in its RNG file runs nothing;
* with ``lr=1e30`` the destroyed weights never become the latest checkpoint.

Step counts are tiny: five runs of a few steps each.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_rl import cli
from megatron_rl.storage.checkpoints import checkpoint_files, file_digest, write_manifest
from tests.e2e.conftest import EXAMPLE, ROOT, TOY, tiny_config, tiny_overrides, train_in_process
from tests.helpers.checkpoints import CORRUPTIONS, largest_shard
from tests.helpers.runs import descendants, logged_steps, wait_for_steps, wait_tree_gone

QUICK = ("trainer.eval_every_steps=0", "logging.token_diagnostics=false")


def _cli(out_dir: Path, *extra: str, dry_run: bool = False) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "megatron_rl", "train", str(EXAMPLE), *tiny_overrides(out_dir, *QUICK, *extra)]
    return subprocess.Popen(cmd + (["--dry-run"] if dry_run else []), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip


def _finish(proc: subprocess.Popen, timeout: float = 600) -> str:
    out, _ = proc.communicate(timeout=timeout)
    return out


def test_an_over_long_prompt_fails_before_ray_starts(tmp_path):
    rows = [json.loads(line) for line in (TOY / "train.jsonl").read_text().splitlines()]
    rows[399]["prompt"] = "copy " + " ".join("1234567890" * 4) + " ="  # 40 digits
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    start = time.monotonic()
    proc = _cli(tmp_path / "out", f"data.train_files=[{data}]")
    out = _finish(proc)
    assert proc.returncode == 2, out
    assert (
        f"error: {data}, row 400, field 'prompt': the prompt has 42 tokens, more than rollout.max_prompt_tokens" in out
    )
    assert "Traceback" not in out and "Ray" not in out  # no Ray process was started
    assert not (tmp_path / "out").exists()  # nothing was written
    assert time.monotonic() - start < 120


def test_kill9_before_the_first_checkpoint_leaves_no_process_and_the_rerun_logs_each_step_once(tmp_path):
    run_dir = tmp_path / "tiny_cpu"
    victim = _cli(tmp_path, "trainer.num_steps=40", "trainer.save_every_steps=0")
    wait_for_steps(victim, run_dir, 2)
    tree = descendants({victim.pid})  # Ray's GCS, raylet, agents, the actor, the engine, reward workers
    assert len(tree) >= 5, tree
    victim.send_signal(signal.SIGKILL)  # the driver alone: nothing of its own clean-up runs
    victim.wait()
    left = wait_tree_gone(tree, timeout_s=10)
    assert not left, f"alive 10 s after the driver was killed: {left}"
    assert not (run_dir / "checkpoints").exists() and logged_steps(run_dir)[:2] == [1, 2]

    rerun = _cli(tmp_path, "trainer.num_steps=3", "trainer.save_every_steps=0")
    out = _finish(rerun)
    assert rerun.returncode == 0, out
    assert logged_steps(run_dir) == [1, 2, 3], "each step once: the dead run's lines were dropped"
    # A quiet screen: the libraries' notices (megatron-core without Apex/TE, deprecations,
    # Ray's token-auth notice) went to RUN_DIR/logs, not to the terminal.
    for noise in ("Apex", "TypedStorage", "FutureWarning", "Token authentication", "Loading weights"):
        assert noise not in out, (noise, out)
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("*.log"))
    assert "Apex is not installed" in logs  # (Ray's token notice depends on the machine: not checked)
    assert "this process is actor rank 0 of 1" in logs and "this process is rollout engine" in logs


@pytest.fixture(scope="module")
def trained(tmp_path_factory, ray_session) -> Path:
    """One 2-step run with a checkpoint after each step, shared by the corruption cases
    (trained in this process: only its files are used)."""
    out_dir = tmp_path_factory.mktemp("trained")
    train_in_process(tiny_config(out_dir, *QUICK, "trainer.num_steps=2", "trainer.save_every_steps=1"))
    return out_dir


def _copy(trained: Path, tmp_path: Path) -> Path:
    shutil.copytree(trained / "tiny_cpu", tmp_path / "tiny_cpu")
    return tmp_path / "tiny_cpu" / "checkpoints"


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_resume_falls_back_past_each_corruption_naming_it(trained, tmp_path, capsys, kind):
    checkpoints = _copy(trained, tmp_path)
    CORRUPTIONS[kind](checkpoints)
    args = ["train", str(EXAMPLE), *tiny_overrides(tmp_path, *QUICK, "trainer.num_steps=3"), "--dry-run"]
    assert cli.main(args) == 0
    err = capsys.readouterr().err
    broken = "latest" if "latest" in kind else "step_000002"
    assert f"warning: config field 'trainer.resume': {checkpoints / broken}" in err, err
    expected = "step_000002" if broken == "latest" else "step_000001"  # a bad pointer: the newest intact one
    assert f"resuming from {checkpoints / expected}" in err, err


class _Payload:
    """Unpickling this writes a file: a stand-in for any code a crafted pickle may run."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_truncated_latest_resumes_from_the_previous_one_and_a_poisoned_rng_file_runs_nothing(trained, tmp_path):
    checkpoints = _copy(trained, tmp_path)
    os.truncate(largest_shard(checkpoints / "step_000002"), 1000)
    marker, step1 = tmp_path / "pwned", checkpoints / "step_000001"
    torch.save({"layout": {"tp": 1, "pp": 1, "dp": 1}, "state": _Payload(marker)}, step1 / "rng" / "rank0.pt")
    # Whoever can plant a file can rewrite the manifest too: the loader itself must refuse.
    write_manifest(step1, {name: file_digest(step1 / name) for name in checkpoint_files(step1)})
    proc = _cli(tmp_path, "trainer.num_steps=3", "trainer.save_every_steps=1")
    out = _finish(proc)
    assert proc.returncode == 0, out
    assert f"{checkpoints / 'step_000002'}: " in out and "truncated" in out
    assert f"resuming from {step1}" in out
    assert "not a tensor-only RNG file, so it was not unpickled" in out
    assert not marker.exists(), "the crafted pickle ran"
    assert logged_steps(tmp_path / "tiny_cpu") == [1, 2, 3]
    assert (checkpoints / "latest").read_text().strip() == "step_000003"


def test_lr_1e30_never_makes_destroyed_weights_the_latest_checkpoint(tmp_path):
    from safetensors.torch import load_file

    from megatron_rl.models.convert.hf_mcore import McoreToHfOptions, mcore_to_hf

    # Warm-up: step 1 trains at lr 0 (a good checkpoint), step 2 at 5e29, which sets the
    # weights near 1e29 - still finite numbers, but no forward pass through them is.
    proc = _cli(tmp_path, "trainer.num_steps=4", "trainer.lr=1e30", "trainer.lr_warmup_steps=2",
                "trainer.save_every_steps=1")  # fmt: skip
    out = _finish(proc)
    assert proc.returncode == 1, out
    assert "error: step 2: the model's parameters are not finite, or so large" in out and "Traceback" not in out
    checkpoints = tmp_path / "tiny_cpu" / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step_000001"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_000001"]
    mcore_to_hf(McoreToHfOptions(mcore_dir=checkpoints / "step_000001", out_dir=tmp_path / "hf"))
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    assert weights and all(torch.isfinite(t).all() for t in weights.values())
    assert logged_steps(tmp_path / "tiny_cpu") == [1, 2]  # the step that stopped the run is logged
