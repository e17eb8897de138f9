"""From prompts and sampled completions to the actor's padded batch.

Row ``g * n + j`` of the batch is sample ``j`` of prompt ``g`` (the pool returns the
``n`` samples of a prompt together, in prompt order), so ``group_index = row // n``.
Columns follow the actor's alignment (``actor/batch.py``): column ``t`` is about token
``input_ids[:, t]``; a response's tokens sit right after its prompt and are the only
columns with ``loss_mask = 1``; rows are right-padded. Each response's advantage is
broadcast to its tokens here (:meth:`Experience.actor_batch`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from megatron_rl.actor.batch import ActorBatch
from megatron_rl.algo import broadcast_to_tokens
from megatron_rl.rollout.base import Completion


@dataclass
class Experience:
    """One RL step's samples as tensors (``N`` responses, ``L`` = longest prompt + response)."""

    batch: ActorBatch
    """``input_ids``, ``attention_mask``, ``loss_mask`` and ``engine_logp`` (the log-probs
    the engines reported for the response tokens, 0 elsewhere); the actor fills the rest."""

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
    lengths = [len(prompt_ids[g]) + len(c.token_ids) for g, c in rows]
    n, width = len(rows), max(lengths)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention = torch.zeros(n, width, dtype=torch.long)
    loss_mask = torch.zeros(n, width, dtype=torch.long)
    engine_logp = torch.zeros(n, width, dtype=torch.float32)
    for i, (g, c) in enumerate(rows):
        p = len(prompt_ids[g])
        end = p + len(c.token_ids)
        input_ids[i, :p] = torch.as_tensor(prompt_ids[g], dtype=torch.long)
        input_ids[i, p:end] = torch.as_tensor(c.token_ids, dtype=torch.long)
        attention[i, :end] = 1
        loss_mask[i, p:end] = 1
        engine_logp[i, p:end] = torch.as_tensor(c.logprobs, dtype=torch.float32)
    return Experience(
        batch=ActorBatch(input_ids=input_ids, attention_mask=attention, loss_mask=loss_mask, engine_logp=engine_logp),
        group_index=torch.tensor([g for g, _ in rows], dtype=torch.long),
        response_lengths=torch.tensor([len(c.token_ids) for _, c in rows], dtype=torch.long),
        weight_versions=[c.weight_version for _, c in rows],
    )
