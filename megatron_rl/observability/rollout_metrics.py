"""The metrics of one step's rollout: rewards, success rate, response lengths, versions."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["rollout_metrics"]


def rollout_metrics(
    rewards: torch.Tensor,
    *,
    success_score: float,
    response_lengths: torch.Tensor,
    weight_versions: Sequence[int],
    reward_counters: Mapping[str, Any] = {},
) -> dict[str, float]:
    """``rollout/*`` metrics of ``[N]`` rewards and ``[N]`` response lengths.

    ``rollout/success_rate`` is the share of responses scoring at least ``success_score``
    (the task's "correct"); ``reward_counters`` (parse failures, time-outs, ...) are added
    as they are, finite numbers only.
    """
    lengths = response_lengths.double()
    out = {
        "rollout/reward/mean": float(rewards.mean()),
        "rollout/reward/std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "rollout/reward/min": float(rewards.min()),
        "rollout/reward/max": float(rewards.max()),
        "rollout/success_rate": float((rewards >= success_score).double().mean()),
        "rollout/response_length/mean": float(lengths.mean()),
        "rollout/response_length/max": float(lengths.max()),
        "rollout/weight_version/min": float(min(weight_versions)),
    }
    out.update({k: float(v) for k, v in reward_counters.items() if isinstance(v, (int, float)) and math.isfinite(v)})
    return out
