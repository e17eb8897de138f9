"""One RL step's experience: prompts drawn, responses generated and scored, and the
actor's padded batch built from them (:func:`collect`, run inline by the synchronous loop
and in the background by the pipelined one).

Row ``g * n + j`` of the batch is sample ``j`` of prompt ``g`` (the pool returns the
``n`` samples of a prompt together, in prompt order), so ``group_index = row // n``.
Columns follow the actor's alignment (``actor/batch.py``): column ``t`` is about token
``input_ids[:, t]``; a response's tokens sit right after its prompt and are the only
columns with ``loss_mask = 1``; rows are right-padded. Each response's advantage is
broadcast to its tokens here (:meth:`Experience.actor_batch`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from megatron_rl.actor.batch import NO_ROUTE, ActorBatch, prompt_response_batch
from megatron_rl.algo import broadcast_to_tokens
from megatron_rl.config.seeding import rollout_seed
from megatron_rl.rollout.generation import Completion, SamplingParams

__all__ = ["Experience", "RolloutBatch", "build_experience", "collect"]


@dataclass
class Experience:
    """One RL step's samples as tensors (``N`` responses, ``L`` = longest prompt + response)."""

    batch: ActorBatch
    """``input_ids``, ``attention_mask``, ``loss_mask``, ``engine_logp`` (the log-probs
    the engines reported for the response tokens, 0 elsewhere) and, when the engines
    returned them (``rollout.routing_replay``), ``routed_experts``; the actor fills the rest."""

    group_index: torch.Tensor
    """``[N]`` int64 prompt index of each response (the GRPO group)."""

    response_lengths: torch.Tensor
    """``[N]`` int64 generated tokens per response."""

    weight_versions: list[int]
    """Weight version that generated each response."""

    def actor_batch(self, advantages_N: torch.Tensor) -> ActorBatch:
        """The batch with each response's advantage (``[N]``) on its response tokens."""
        return replace(self.batch, advantages=broadcast_to_tokens(advantages_N, self.batch.loss_mask))


def build_experience(
    prompt_ids: Sequence[Sequence[int]], completions: Sequence[Sequence[Completion]], *, pad_id: int
) -> Experience:
    """Pack prompt + completion token ids into a right-padded batch.

    Args:
        prompt_ids: ``G`` prompts as token ids.
        completions: per prompt, its ``n`` completions (same ``n`` for every prompt).
        pad_id: id written into padding (never trained on; any id in the vocabulary).
    """
    rows = [(g, c) for g, group in enumerate(completions) for c in group]
    batch = prompt_response_batch([(prompt_ids[g], c.token_ids) for g, c in rows], pad_id=pad_id)
    engine_logp = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
    for i, (g, c) in enumerate(rows):
        p = len(prompt_ids[g])
        engine_logp[i, p : p + len(c.token_ids)] = torch.as_tensor(c.logprobs, dtype=torch.float32)
    routes = _routed_experts(prompt_ids, rows, batch.input_ids.shape[1])
    return Experience(
        batch=replace(batch, engine_logp=engine_logp, routed_experts=routes),
        group_index=torch.tensor([g for g, _ in rows], dtype=torch.long),
        response_lengths=torch.tensor([len(c.token_ids) for _, c in rows], dtype=torch.long),
        weight_versions=[c.weight_version for _, c in rows],
    )


def _routed_experts(prompt_ids: Sequence[Sequence[int]], rows: list, width: int) -> torch.Tensor | None:
    """``[N, L, M, k]`` the engines' routed experts laid out like ``input_ids`` (-1 on each
    sequence's last token and on padding), or ``None`` when no completion carries them."""
    have = [c.routed_experts is not None for _, c in rows]
    if not any(have):
        return None
    if not all(have):
        c = rows[have.index(False)][1]
        raise ValueError(f"engine {c.engine!r} returned a completion without routed experts while others have them")
    shape = rows[0][1].routed_experts.shape[1:]
    routes = torch.full((len(rows), width, *shape), NO_ROUTE, dtype=torch.int16)
    for i, (g, c) in enumerate(rows):
        ran = len(prompt_ids[g]) + len(c.token_ids) - 1  # every token but the last went through the model
        got = c.routed_experts
        if tuple(got.shape) != (ran, *shape):
            raise ValueError(
                f"engine {c.engine!r}: routed experts of shape {tuple(got.shape)} for a {len(prompt_ids[g])}-token "
                f"prompt and {len(c.token_ids)} generated tokens; want ({ran}, {', '.join(map(str, shape))})"
            )
        routes[i, :ran] = got
    return routes


@dataclass(kw_only=True)
class RolloutBatch:
    """One RL step's prompts, completions, rewards and padded batch (:func:`collect`)."""

    step: int
    """The RL step that trains on it."""
    prompts: Any
    """The drawn prompts (``data.source``'s batch: token ids, rows, texts)."""
    completions: list
    """Per prompt, its completions (``rollout.generation.Completion``), in prompt order."""
    generate_s: float
    """Seconds the generation took."""
    rewards: list | None = None
    """The reward results of every response, prompt-major (``rewards.RewardResult``)."""
    reward_s: float = 0.0
    """Seconds the scoring took."""
    experience: Experience | None = None
    """The update's padded batch of prompts and responses."""
    cursor: dict | None = None
    """The data cursor (sampler state) from before these prompts were drawn."""


def collect(run: Any, step: int) -> RolloutBatch:
    """Draw step ``step``'s prompts, generate their responses on the pool, score them and
    batch them (``run``: the components, ``loop.builder.Run``)."""
    cfg = run.config
    start = time.perf_counter()
    cursor = run.prompts.state_dict()
    prompts = run.prompts.next_prompts(cfg.rollout.num_prompts_per_step)
    params = SamplingParams.from_rollout_config(
        cfg.rollout, seed=rollout_seed(cfg.trainer.seed, step), stop_token_ids=run.prompts.stop_token_ids
    )
    completions = run.pool.generate(prompts.token_ids, params)
    generated = time.perf_counter()
    n = cfg.rollout.num_samples_per_prompt
    responses = [run.prompts.decode(c.token_ids) for group in completions for c in group]
    ground_truths = [row.ground_truth for row in prompts.rows for _ in range(n)]
    texts = [text for text in prompts.texts for _ in range(n)]
    rewards = run.rewards.score(responses, ground_truths, texts)
    scored = time.perf_counter()
    return RolloutBatch(
        step=step, prompts=prompts, completions=completions, generate_s=generated - start, rewards=rewards,
        reward_s=scored - generated, experience=build_experience(prompts.token_ids, completions, pad_id=run.prompts.pad_id),
        cursor=cursor,
    )  # fmt: skip
