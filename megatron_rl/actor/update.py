"""One RL step's policy update on an actor rank: old/reference log-probs, then the passes.

The driver hands every rank the step's batch once (prompt + response tokens, masks, the
engines' log-probs, token advantages before any reweighting); :func:`update_policy`
then does on each rank, collectively:

1. the old policy's log-probs at the rollout temperature (the PPO ratio's denominator,
   and what the token-weight methods read), and the reference policy's when the loss
   has a KL term;
2. the engine/actor log-prob mismatch metrics and, with ``rollout.tis_cap``, the
   truncated importance weights (``algo.mismatch``), multiplied into the advantages once;
3. the update: for each phase of ``algo.update_phases`` (one, or Lopti's low then high
   pass), ``trainer.num_epochs_per_step`` epochs, each split into
   ``trainer.num_minibatches_per_step`` mini-batches in a seeded order
   (``seeding.minibatch_seed``), one optimizer step each (``MegatronActor.train_step``);
4. with ``token_stats``, the token-probability diagnostics (per-token logit-gradient
   norms of the first pass and epoch, and the log-probs after the update).

It never names a method: phases, pre-passes and weights come from the ``algo`` registry.
Metrics are means over the optimizer steps, except ``actor/step_skipped`` (a count) and
``actor/updates``.
"""

from __future__ import annotations

import random
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import torch

from megatron_rl.actor.actor import MegatronActor
from megatron_rl.actor.batch import ActorBatch
from megatron_rl.actor.reference import ReferencePolicy
from megatron_rl.algo import logprob_mismatch, update_phases
from megatron_rl.observability.diagnostics import token_probability_diagnostics
from megatron_rl.seeding import minibatch_seed

__all__ = ["minibatch_rows", "timed", "update_policy"]


@contextmanager
def timed(timings: dict[str, float], name: str) -> Iterator[None]:
    """Add the wall time of the ``with`` block to ``timings[name]`` (seconds)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - start


def minibatch_rows(num_rows: int, num_minibatches: int, *, seed: int) -> list[torch.Tensor]:
    """Split ``num_rows`` responses into ``num_minibatches`` equal mini-batches, in a
    seeded random order (so every mini-batch mixes prompts, as PPO-style epochs do)."""
    if num_rows % num_minibatches:
        raise ValueError(f"{num_rows} responses do not split into {num_minibatches} equal mini-batches")
    order = list(range(num_rows))
    random.Random(seed).shuffle(order)
    size = num_rows // num_minibatches
    return [torch.tensor(sorted(order[k * size : (k + 1) * size])) for k in range(num_minibatches)]


def update_policy(
    actor: MegatronActor, reference: ReferencePolicy | None, batch: ActorBatch, *, step: int, token_stats: bool = False
) -> dict[str, float]:
    """All of RL step ``step``'s optimizer steps on ``batch``; returns its metrics.

    Args:
        actor: this rank's actor (its spec fixes the loss, temperature and schedule).
        reference: this rank's reference policy, when the loss has a KL term.
        batch: ``[N, L]`` tokens, ``loss_mask``, ``advantages`` (token advantages before
            reweighting) and ``engine_logp`` (the engines' log-probs; optional).
        step: the RL step (seeds the mini-batch order).
        token_stats: also compute the token-probability diagnostics (``tokens/*``).

    Collective over the actor's world; every rank returns the same metrics (timings are
    this rank's).
    """
    spec = actor.spec
    timings: dict[str, float] = {}
    metrics: dict[str, float] = {}
    with timed(timings, "logprobs"):
        old = actor.compute_logprobs(batch)
        ref_logp = None
        if spec.with_reference:
            if reference is None:
                raise RuntimeError("the loss has a KL term but this actor rank holds no reference policy")
            ref_logp = reference.compute_logprobs(batch).logp
        advantages = batch.advantages
        if batch.engine_logp is not None:
            mismatch = logprob_mismatch(batch.engine_logp, old.logp, batch.loss_mask, tis_cap=spec.rollout.tis_cap)
            metrics.update(mismatch.metrics)
            if mismatch.tis_weights is not None:
                advantages = advantages * mismatch.tis_weights
        batch = replace(batch, old_logp=old.logp, ref_logp=ref_logp, advantages=advantages)

    trainer = spec.trainer
    sums: dict[str, float] = defaultdict(float)
    updates = 0
    grad_norms = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
    with timed(timings, "train"):
        for p, phase in enumerate(update_phases(actor.algorithm)):
            for epoch in range(trainer.num_epochs_per_step):
                seed = minibatch_seed(trainer.seed, step, p, epoch)
                for rows in minibatch_rows(batch.num_sequences, trainer.num_minibatches_per_step, seed=seed):
                    want_norms = token_stats and p == 0 and epoch == 0
                    m = actor.train_step(batch.select(rows), phase=phase, token_grad_norms=want_norms)
                    if want_norms:
                        grad_norms[rows] = actor.last_token_grad_norms
                    for k, v in m.items():
                        sums[k] += v
                    updates += 1
    skipped = sums.get("actor/step_skipped", 0.0)
    metrics.update({k: v / updates for k, v in sums.items()})
    metrics["actor/step_skipped"] = skipped
    metrics["actor/updates"] = float(updates)

    if token_stats:
        with timed(timings, "diagnostics"):
            new = actor.compute_logprobs(batch)
            metrics.update(
                token_probability_diagnostics(old.logp, batch.loss_mask, logit_grad_norm=grad_norms, new_logp=new.logp)
            )
    metrics.update({f"timing_s/{k}": v for k, v in timings.items()})
    metrics["throughput/train_tokens_per_s"] = float(batch.attention_mask.sum()) / max(timings["train"], 1e-9)
    return metrics
