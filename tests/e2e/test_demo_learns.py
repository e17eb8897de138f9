"""The embedded CPU demo visibly learns: on 3 seeds, the mean reward of the last steps
exceeds that of the first steps by far more than the step-to-step noise."""

import statistics

import pytest

from megatron_rl.observability import read_metrics
from megatron_rl.trainer import Trainer
from tests.e2e.conftest import tiny_config

NUM_STEPS, WINDOW = 250, 25


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_tiny_demo_reward_rises_beyond_noise(seed, tmp_path, ray_session):
    cfg = tiny_config(
        tmp_path, f"trainer.num_steps={NUM_STEPS}", f"trainer.seed={seed}", "trainer.eval_every_steps=0",
        "trainer.save_every_steps=0", "logging.token_diagnostics=false",
    )  # fmt: skip
    trainer = Trainer(cfg)
    try:
        trainer.run()
    finally:
        trainer.close()
    rewards = [r["rollout/reward/mean"] for r in read_metrics(cfg.run_dir)]
    assert len(rewards) == NUM_STEPS
    first, last = rewards[:WINDOW], rewards[-WINDOW:]
    rise = statistics.mean(last) - statistics.mean(first)
    # standard error of the difference of two window means
    noise = (statistics.variance(first) / WINDOW + statistics.variance(last) / WINDOW) ** 0.5
    assert rise > max(0.1, 5 * noise), f"seed {seed}: rise {rise:.3f}, noise {noise:.3f}, rewards {rewards[::25]}"
