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
    actor_version: int | None = None,
) -> dict[str, float]:
    """``rollout/*`` metrics of ``[N]`` rewards and ``[N]`` response lengths.

    With ``actor_version`` (the weights the actor trains from), the staleness of each
    response (``actor_version`` minus the version that generated it) is summarised as
    ``rollout/staleness/max`` and ``rollout/staleness/mean``.

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
    if actor_version is not None:
        staleness = [actor_version - v for v in weight_versions]
        out["rollout/staleness/max"] = float(max(staleness))
        out["rollout/staleness/mean"] = sum(staleness) / len(staleness)
    out.update({k: float(v) for k, v in reward_counters.items() if isinstance(v, (int, float)) and math.isfinite(v)})
    return out
