"""Fixtures for end-to-end runs of the trainer on the tiny CPU demo."""

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
    from megatron_rl.config import load_run_config

    return load_run_config(EXAMPLE, tiny_overrides(output_dir, *extra))


@pytest.fixture(scope="module")
def ray_session():
    import ray

    ray.init(include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield
    ray.shutdown()


def kill9_when(victim, run_dir, *, checkpointed: int, logged: int, timeout_s: float = 600) -> None:
    """SIGKILL the process group of ``victim`` (a ``train`` CLI run) once checkpoint
    ``step_<checkpointed>`` exists and step ``logged`` is in ``metrics.jsonl``."""
    import os
    import signal
    import time

    from megatron_rl.observability import read_metrics

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if (run_dir / "checkpoints" / f"step_{checkpointed:06d}").is_dir() and (run_dir / "metrics.jsonl").exists():
            if any(r["step"] >= logged for r in read_metrics(run_dir)):
                break
        if victim.poll() is not None:
            pytest.fail("the run finished before it could be killed:\n" + victim.stdout.read())
        time.sleep(0.05)
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
