"""Collectives of the actor's results: per-token values and metric reports to every rank.

Pipeline parallelism leaves the outputs (log-probs, the loss functions' reports) on the
last stage, and data parallelism splits the rows over replicas; these functions bring a
step's results to every rank of the world, so any rank (rank 0, which answers the
driver) can return them. Each docstring names the groups its collectives run on.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_rl.actor.batch import MicroBatch
from megatron_rl.actor.launch import ProcessGroups
from megatron_rl.algo import merge_metrics

__all__ = ["broadcast_from_last_stage", "device", "gather_token_values", "reduce_reports"]


def device() -> torch.device:
    """The device of this rank's tensors: its CUDA device, or the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def broadcast_from_last_stage(value: int, groups: ProcessGroups) -> int:
    """``value`` from the last pipeline stage, on every rank of the PP group."""
    if groups.pp_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device())
    dist.broadcast(t, src=groups.last_stage_global_rank, group=groups.pp)
    return int(t)


def gather_token_values(
    groups: ProcessGroups,
    n: int,
    length: int,
    num_local: int,
    microbatches: list[MicroBatch],
    values: list[list[torch.Tensor]],
) -> torch.Tensor:
    """Per-micro-batch, target-aligned values (last stage; ``[b, s]``, or ``[1, S]`` packed)
    as input-aligned ``[K, n, length]`` float32 on EVERY rank.

    Each value is shifted by one column (target column ``t`` predicts input column
    ``t + 1``), this DP rank's rows (``dp_rank::dp_size``, ``num_local`` of them) are
    all-gathered over the DP group on the last stage, and the result is broadcast from
    the last stage over the PP group (TP ranks hold identical values already).
    """
    k = broadcast_from_last_stage(len(values[0]) if values else 0, groups)
    local = torch.zeros(k, num_local, length, dtype=torch.float32, device=device())
    for mb, vals in zip(microbatches, values):
        if not len(mb.rows):  # a filler micro-batch (actor.batch.filler_microbatch): no sequence's values
            continue
        for j, v in enumerate(vals):
            rows = mb.per_row(v)  # [b, s]: one zero-padded row per sequence
            w = min(rows.shape[1], length)  # a micro-batch padded past the batch's width: drop the padding
            local[j, mb.rows, 1:w] = rows[:, : w - 1].float()
    if groups.dp_size == 1:  # every row is this rank's: nothing to gather (a collective costs ~0.5 ms on gloo)
        full = local
    else:
        full = torch.zeros(k, n, length, dtype=torch.float32, device=device())
        if groups.is_last_stage:
            per_rank = -(-n // groups.dp_size)
            padded = torch.zeros(k, per_rank, length, dtype=torch.float32, device=device())
            padded[:, :num_local] = local
            gathered = [torch.empty_like(padded) for _ in range(groups.dp_size)]
            dist.all_gather(gathered, padded, group=groups.dp)
            for d, part in enumerate(gathered):
                count = len(range(d, n, groups.dp_size))
                full[:, d :: groups.dp_size] = part[:, :count]
    if groups.pp_size > 1:
        dist.broadcast(full, src=groups.last_stage_global_rank, group=groups.pp)
    return full


def reduce_reports(groups: ProcessGroups, parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Sum ``{name: [sum, count]}`` reports over micro-batches and the DP group (last stage),
    then broadcast the result from the last stage over the PP group, so every rank holds it."""
    payload: list[Any] = [None]
    if groups.is_last_stage:
        merged = {k: v.double().cpu() for k, v in merge_metrics(parts).items()}
        if groups.dp_size > 1:
            everyone: list[Any] = [None] * groups.dp_size
            dist.all_gather_object(everyone, merged, group=groups.dp)
            merged = merge_metrics(everyone)  # same order on every rank: identical sums
        payload = [merged]
    if groups.pp_size > 1:
        dist.broadcast_object_list(payload, src=groups.last_stage_global_rank, group=groups.pp)
    return payload[0]
