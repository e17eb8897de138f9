"""Fixtures for end-to-end runs of the trainer on the tiny CPU demo."""

from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny_cpu.yaml"
TOY = ROOT / "examples" / "data" / "toy"


def tiny_overrides(output_dir, *extra: str) -> list[str]:
    """Overrides that make the example run anywhere (absolute data paths, a temp run dir)."""
    return [
        f"trainer.output_dir={output_dir}",
        f"data.train_files=[{TOY / 'train.jsonl'}]",
        f"data.eval_files=[{TOY / 'test.jsonl'}]",
        f"model.tokenizer={TOY / 'tokenizer'}",
        "logging.wandb_mode=disabled",
        *extra,
    ]


def tiny_config(output_dir, *extra: str):
    from megatron_rl.config.run import load_run_config

    return load_run_config(EXAMPLE, tiny_overrides(output_dir, *extra))


@pytest.fixture(scope="module")
def ray_session():
    import ray

    ray.init(include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield
    ray.shutdown()


def train_cli(out_dir, *extra):
    """``megatron-rl train`` of the tiny demo in a new process group (so a kill reaches every process)."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "megatron_rl", "train", str(EXAMPLE), *tiny_overrides(out_dir, *extra)]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip


@dataclass
class KilledAndResumed:
    """What :func:`kill9_and_resume` leaves: both runs' metrics by step, and the checkpoint
    ``latest`` named right after the kill."""

    uninterrupted: dict[int, dict]
    resumed: dict[int, dict]
    run_dir: Path
    latest_after_kill: str


def kill9_and_resume(tmp_path, *args: str, checkpointed: int, logged: int) -> KilledAndResumed:
    """Run the demo with ``args`` uninterrupted (``tmp_path/a``); run it again (``tmp_path/b``),
    SIGKILL its process group once checkpoint ``step_<checkpointed>`` exists and step
    ``logged`` is in ``metrics.jsonl``, then rerun it there to the end (it resumes)."""
    import os
    import signal
    import time

    from megatron_rl.observability import read_metrics

    ref = train_cli(tmp_path / "a", *args)
    out, _ = ref.communicate(timeout=600)
    assert ref.returncode == 0, out

    victim = train_cli(tmp_path / "b", *args)
    run_dir = tmp_path / "b" / "tiny_cpu"
    deadline = time.time() + 600
    while time.time() < deadline:
        if (run_dir / "checkpoints" / f"step_{checkpointed:06d}").is_dir() and (run_dir / "metrics.jsonl").exists():
            if any(r["step"] >= logged for r in read_metrics(run_dir)):
                break
        if victim.poll() is not None:
            pytest.fail("the run finished before it could be killed:\n" + victim.stdout.read())
        time.sleep(0.05)
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()

    resumed = train_cli(tmp_path / "b", *args)
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out
    return KilledAndResumed(
        uninterrupted={r["step"]: r for r in read_metrics(tmp_path / "a" / "tiny_cpu")},
        resumed={r["step"]: r for r in read_metrics(run_dir)},
        run_dir=run_dir,
        latest_after_kill=latest,
    )
