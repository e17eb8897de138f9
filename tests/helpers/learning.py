"""Whether a run learned: the reward of its last steps against its first, beyond the noise.
Shared by the learning tests of the built-in engine (tests/e2e/test_demo_learns.py) and of
vLLM (tests/vllm/test_vllm_moe.py)."""

from __future__ import annotations

import statistics

WINDOW = 20
"""Steps per window: the first and the last ``WINDOW`` steps are compared."""

MIN_RISE = 0.04
"""The smallest rise of the window means that counts, whatever the noise."""

MIN_STANDARD_ERRORS = 5
"""The rise must exceed this many standard errors of the difference of the window means."""


def rise_and_noise(rewards: list[float]) -> tuple[float, float]:
    """The mean reward of the last ``WINDOW`` steps minus that of the first ``WINDOW``, and the
    standard error of that difference (the two windows' variances over their sizes)."""
    first, last = rewards[:WINDOW], rewards[-WINDOW:]
    noise = (statistics.variance(first) / WINDOW + statistics.variance(last) / WINDOW) ** 0.5
    return statistics.mean(last) - statistics.mean(first), noise


def assert_learns(rewards: list[float], label: str) -> None:
    """The rise exceeds both :data:`MIN_RISE` and :data:`MIN_STANDARD_ERRORS` standard errors."""
    rise, noise = rise_and_noise(rewards)
    assert rise > max(MIN_RISE, MIN_STANDARD_ERRORS * noise), (
        f"{label}: rise {rise:.3f}, noise {noise:.3f}, rewards {[round(r, 3) for r in rewards[::10]]}"
    )
