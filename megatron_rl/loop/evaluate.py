"""Evaluation: accuracy on the eval prompts, greedy and sampled, per the task's groups."""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import replace

from megatron_rl.config.rollout import RolloutConfig
from megatron_rl.config.seeding import eval_seed
from megatron_rl.data.source import PromptSource
from megatron_rl.rewards import RewardPool, summarize
from megatron_rl.rollout.generation import SamplingParams
from megatron_rl.rollout.pool.pool import RolloutPool
from megatron_rl.tasks import Task

__all__ = ["evaluate"]


def evaluate(
    *,
    pool: RolloutPool,
    prompts: PromptSource,
    task: Task,
    rewards: RewardPool,
    rollout: RolloutConfig,
    seed: int,
    step: int,
) -> dict[str, float]:
    """One response per eval prompt, greedy and at the rollout temperature, scored by the task.

    Metrics: ``eval/accuracy/{group}/{mode}`` (share of responses scoring at least the
    reward's ``success_score``; groups from ``task.eval_group``, e.g. ``n3`` for 3-person
    K&K puzzles), ``eval/accuracy/mean/{mode}``, ``eval/reward/mean/{mode}``,
    ``eval/accuracy/mean`` (= greedy) and ``timing_s/eval``. Empty without eval prompts.
    """
    if not prompts.eval_rows:
        return {}
    start = time.perf_counter()
    batch = prompts.eval_prompts()
    groups = [task.eval_group(row) for row in batch.rows]
    success = task.reward.success_score
    out: dict[str, float] = {}
    for mode, temperature in (("greedy", 0.0), ("sampled", rollout.temperature)):
        params = SamplingParams.from_rollout_config(
            rollout, seed=eval_seed(seed, step), stop_token_ids=prompts.stop_token_ids
        )
        completions = pool.generate(batch.token_ids, replace(params, n=1, temperature=temperature))
        responses = [prompts.decode(group[0].token_ids) for group in completions]
        scores, _ = summarize(rewards.score(responses, [r.ground_truth for r in batch.rows], batch.texts))
        hits: dict[str, list[float]] = defaultdict(list)
        for g, s in zip(groups, scores):
            hits[g].append(float(s >= success))
        for g, h in sorted(hits.items()):
            out[f"eval/accuracy/{g}/{mode}"] = sum(h) / len(h)
        out[f"eval/accuracy/mean/{mode}"] = sum(sum(h) for h in hits.values()) / len(scores)
        out[f"eval/reward/mean/{mode}"] = sum(scores) / len(scores)
    out["eval/accuracy/mean"] = out["eval/accuracy/mean/greedy"]
    out["timing_s/eval"] = time.perf_counter() - start
    return out
