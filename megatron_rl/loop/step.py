"""The pieces of one RL step that both loops (``trainer.py``, ``pipeline.py``) share: a
batch's advantages and rollout metrics, its update submitted to the actor and finished,
and the step's timing metrics.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_rl.actor.group import NonFiniteStepsError
from megatron_rl.algo import compute_advantages
from megatron_rl.loop.experience import Experience, RolloutBatch
from megatron_rl.observability import rollout_metrics
from megatron_rl.rewards import AllRewardsFailedError, RewardErrorStreak, summarize

__all__ = ["StartedUpdate", "finish_update", "step_metrics", "submit_update"]


@dataclass(kw_only=True)
class StartedUpdate:
    """One step's update, submitted to the actor (or the error that replaces it)."""

    step: int
    exp: Experience
    metrics: dict[str, float]
    """The step's rollout metrics so far."""
    timings: dict[str, float] = field(default_factory=dict)
    pending: Any = None
    """The actor's pending results (``ActorGroup.submit_update``)."""
    submitted_at: float = 0.0
    error: BaseException | None = None
    """Raised instead of updating (every reward failed): the step is logged, then the run stops."""


def submit_update(
    run: Any, batch: RolloutBatch, timings: dict[str, float], reward_errors: RewardErrorStreak, *, prepare_sync: bool
) -> StartedUpdate:
    """Advantages and rollout metrics of ``batch``, then its update submitted to the actor
    (``run``: ``loop.builder.Run``); ``prepare_sync``: queue the weight sync's actor-side
    work right behind the update (not when the actor gives the devices back first)."""
    cfg, exp = run.config, batch.experience
    timings["reward"] = batch.reward_s  # scored with the generation
    scores, counters = summarize(batch.rewards)
    rewards = torch.tensor(scores, dtype=torch.float64)
    advantages = compute_advantages(rewards, exp.group_index, cfg.algorithm.advantage)
    metrics = rollout_metrics(
        rewards, success_score=run.task.reward.success_score, response_lengths=exp.response_lengths,
        weight_versions=exp.weight_versions, reward_counters=counters, actor_version=batch.step - 1,
    )  # fmt: skip
    # Where in the data this step's prompts start (resumes continue it without a gap or a repeat).
    metrics.update({"data/epoch": float(batch.cursor["epoch"]), "data/position": float(batch.cursor["position"])})
    started = StartedUpdate(step=batch.step, exp=exp, metrics=metrics, timings=timings)
    try:
        reward_errors.update(batch.step, batch.rewards)
    except AllRewardsFailedError as e:
        started.error = e
        return started
    started.submitted_at = time.perf_counter()
    started.pending = run.actors.submit_update(exp.actor_batch(advantages), batch.step,
                                               token_stats=cfg.logging.token_diagnostics)  # fmt: skip
    if prepare_sync:
        run.weight_sync.prepare(batch.step)
    return started


def finish_update(run: Any, started: StartedUpdate) -> dict[str, float]:
    """The update's metrics; a step that stops the run (non-finite, every reward failed) is logged first."""
    metrics = started.metrics
    try:
        if started.error is not None:
            raise started.error
        metrics.update(run.actors.finish_update(started.pending))
        # From the submission (the step before's end, when submitted early) to the result.
        started.timings["update"] = time.perf_counter() - started.submitted_at
    except (NonFiniteStepsError, AllRewardsFailedError) as e:
        run.sink.log(started.step, {**metrics, "actor/step_skipped": 1.0, **getattr(e, "metrics", {})})
        raise
    return metrics


def step_metrics(metrics: dict, timings: dict, exp: Experience, start: float) -> dict[str, float]:
    """The step's metrics with its timings (``timing_s/*``) and throughput; ``start``: the step's ``perf_counter``."""
    metrics.update({f"timing_s/{k}": v for k, v in timings.items()})
    metrics["timing_s/step"] = seconds = time.perf_counter() - start
    metrics["throughput/tokens_per_s"] = float(exp.response_lengths.sum()) / seconds
    return metrics
