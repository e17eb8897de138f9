"""One RL step's policy update on an actor rank: old/reference log-probs, then the passes.

The driver hands every rank the step's batch once (prompt + response tokens, masks, the
engines' log-probs, token advantages before any reweighting); :func:`update_policy`
then does on each rank, collectively:

1. the old policy's log-probs at the rollout temperature (the PPO ratio's denominator,
   and what the token-weight methods read), and the reference policy's when the loss
   has a KL term. With ``actor.old_logp_source: auto`` (:func:`old_logp_from_train_forward`)
   the first optimizer step's mini-batch takes them from its own train forward, whose
   weights are the old policy's, and only the other rows get a forward-only pass here;
2. with ``rollout.tis_cap``, the truncated importance weights (``algo.mismatch``),
   multiplied into the advantages once: before the update for the rows whose old
   log-probs are known; inside the loss for the first optimizer step's rows when they
   come from its forward (and into their advantages after it, for later passes); the
   engine/actor log-prob mismatch metrics once the old log-probs of every row are known;
3. the update: for each phase of ``algo.update_phases`` (one, or Lopti's low then high
   pass), ``trainer.num_epochs_per_step`` epochs, each split into
   ``trainer.num_minibatches_per_step`` mini-batches in a seeded order
   (``seeding.minibatch_seed``), one optimizer step each (``MegatronActor.train_step``);
4. with ``token_stats``, the token-probability diagnostics (per-token logit-gradient
   norms of the first pass and epoch, and the log-probs after the update).

It never names a method: phases, pre-passes and weights come from the ``algo`` registry.
Metrics are means over the optimizer steps, except ``actor/step_skipped`` (a count),
``actor/updates`` and ``actor/old_logp_from_forward_frac`` (the share of rows whose old
log-probs came from the first optimizer step's forward rather than a separate pass).
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
from megatron_rl.actor.reference import AdaptersOffReference, ReferencePolicy
from megatron_rl.actor.spec import ActorSpec
from megatron_rl.algo import (
    logprob_mismatch,
    needs_prepass,
    old_logp_before_forward,
    truncated_is_weights,
    update_phases,
)
from megatron_rl.config.seeding import minibatch_seed
from megatron_rl.observability.diagnostics import token_probability_diagnostics

__all__ = ["minibatch_rows", "old_logp_from_train_forward", "timed", "update_policy"]


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


def old_logp_from_train_forward(spec: ActorSpec) -> bool:
    """Whether the first optimizer step of an RL step takes its mini-batch's old log-probs
    from its own train forward (``actor.old_logp_source: auto``, and nothing reads them
    before that forward: no Advantage Reweighting, and with ``rollout.tis_cap`` no
    pre-pass, which reads the TIS-weighted advantages; the loss applies that step's TIS
    weights itself)."""
    return (
        spec.actor.old_logp_source == "auto"
        and not old_logp_before_forward(spec.algorithm)
        and not (spec.rollout.tis_cap is not None and needs_prepass(spec.algorithm))
    )


def _apply_tis(batch: ActorBatch, rows: torch.Tensor | list[int], tis_cap: float) -> None:
    """Multiply the advantages of ``rows`` (in place) by their truncated importance weights,
    from their old log-probs against the engines' (``algo.truncated_is_weights``)."""
    index = torch.as_tensor(rows, dtype=torch.long)
    batch.advantages[index] *= truncated_is_weights(
        batch.old_logp[index], batch.engine_logp[index], batch.loss_mask[index], tis_cap
    ).to(batch.advantages.dtype)


def _schedule(spec: ActorSpec, num_rows: int, step: int) -> list[tuple[str | None, torch.Tensor]]:
    """Every optimizer step of RL step ``step`` in order: ``(phase, rows)``."""
    trainer = spec.trainer
    out = []
    for p, phase in enumerate(update_phases(spec.algorithm)):
        for epoch in range(trainer.num_epochs_per_step):
            seed = minibatch_seed(trainer.seed, step, p, epoch)
            out += [(phase, rows) for rows in minibatch_rows(num_rows, trainer.num_minibatches_per_step, seed=seed)]
    return out


def update_policy(
    actor: MegatronActor, reference: ReferencePolicy | AdaptersOffReference | None, batch: ActorBatch, *, step: int, token_stats: bool = False
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
    schedule = _schedule(spec, batch.num_sequences, step)
    from_forward = old_logp_from_train_forward(spec)
    tis_cap = spec.rollout.tis_cap if batch.engine_logp is not None else None
    with timed(timings, "logprobs"):
        if from_forward:  # only the rows the first optimizer step does not train on
            known = sorted(set(range(batch.num_sequences)) - set(schedule[0][1].tolist()))
            old_logp = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
            if known:
                old_logp[known] = actor.compute_logprobs(batch.select(known)).logp
        else:
            known = list(range(batch.num_sequences))
            old_logp = actor.compute_logprobs(batch).logp
        ref_logp = None
        if spec.with_reference:
            if reference is None:
                raise RuntimeError("the loss has a KL term but this actor rank holds no reference policy")
            ref_logp = reference.compute_logprobs(batch).logp
        batch = replace(batch, old_logp=old_logp, ref_logp=ref_logp)
        if tis_cap is not None:  # a copy: the weights go into it in place
            batch = replace(batch, advantages=batch.advantages.clone())
            if known:
                _apply_tis(batch, known, tis_cap)

    sums: dict[str, float] = defaultdict(float)
    updates = 0
    grad_norms = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
    with timed(timings, "train"):
        for k, (phase, rows) in enumerate(schedule):
            want_norms = token_stats and k < spec.trainer.num_minibatches_per_step  # first pass, first epoch
            on_policy = from_forward and k == 0
            m = actor.train_step(
                batch.select(rows), phase=phase, token_grad_norms=want_norms, on_policy=on_policy,
                tis_cap=tis_cap if on_policy else None,
            )  # fmt: skip
            if want_norms:
                grad_norms[rows] = actor.last_token_grad_norms
            if on_policy:
                batch.old_logp[rows] = actor.last_train_logp
                if tis_cap is not None:  # the loss applied them; later passes over these rows need them too
                    _apply_tis(batch, rows, tis_cap)
            for key, v in m.items():
                sums[key] += v
            updates += 1
    if batch.engine_logp is not None:
        metrics.update(logprob_mismatch(batch.engine_logp, batch.old_logp, batch.loss_mask, tis_cap=tis_cap).metrics)
    skipped = sums.get("actor/step_skipped", 0.0)
    metrics.update({k: v / updates for k, v in sums.items()})
    metrics["actor/step_skipped"] = skipped
    metrics["actor/updates"] = float(updates)
    metrics["actor/old_logp_from_forward_frac"] = len(schedule[0][1]) / batch.num_sequences if from_forward else 0.0

    if token_stats:
        with timed(timings, "diagnostics"):
            new = actor.compute_logprobs(batch)
            metrics.update(
                token_probability_diagnostics(
                    batch.old_logp, batch.loss_mask, logit_grad_norm=grad_norms, new_logp=new.logp
                )
            )
    metrics.update({f"timing_s/{k}": v for k, v in timings.items()})
    metrics["throughput/train_tokens_per_s"] = float(batch.attention_mask.sum()) / max(timings["train"], 1e-9)
    return metrics
