"""Every Ray placement decision of a run: where actor ranks and rollout engines run.

A group of Ray actors (the actor's ranks, the rollout engines) is placed by a
:class:`GroupPlacement`: one set of Ray options per member (CPUs, GPUs, scheduling
strategy) and the torch thread count of its processes. The builder asks this module for
both groups; the actor group and the rollout pool only apply what they are given.

Today's layout is colocated: on CPU the actor ranks reserve no Ray CPU and each engine
one, so a 2-core machine runs one actor rank and one engine side by side
(time-sliced); on GPUs each actor rank holds one GPU and the engines reserve none (they
share the actor's devices). ``parallel.ray_scheduling: spread`` pins contiguous blocks
of each group to the alive nodes (:func:`spread_strategies`). After start-up the Ray
node of every member is recorded in ``RUN_DIR/placement.json`` (:func:`write_placement`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_rl.config.parallel import ParallelConfig
from megatron_rl.config.rollout import RolloutConfig

__all__ = [
    "GroupPlacement",
    "actor_placement",
    "engine_placement",
    "spread_strategies",
    "write_placement",
]

_RAY_STRATEGIES = {"default": "DEFAULT", "spread": "SPREAD"}


@dataclass(frozen=True)
class GroupPlacement:
    """Where each member of a group of Ray actors runs."""

    ray_options: tuple[dict[str, Any], ...]
    """Per member: the Ray actor options ``num_cpus``, ``num_gpus`` and
    ``scheduling_strategy``."""

    torch_threads: int = 1
    """torch intra-op threads of each member process on CPU."""

    def __len__(self) -> int:
        return len(self.ray_options)

    @classmethod
    def uniform(
        cls, count: int, *, num_cpus: float = 0.0, num_gpus: float = 0.0, strategy: Any = "DEFAULT",
        torch_threads: int = 1,
    ) -> GroupPlacement:  # fmt: skip
        """``count`` members with the same resources; ``strategy`` ``SPREAD`` pins blocks to
        nodes (:func:`spread_strategies`), anything else is handed to Ray unchanged."""
        strategies = spread_strategies(count, num_cpus=num_cpus, num_gpus=num_gpus) if strategy == "SPREAD" else [
            strategy
        ] * count
        options = tuple({"num_cpus": num_cpus, "num_gpus": num_gpus, "scheduling_strategy": s} for s in strategies)
        return cls(ray_options=options, torch_threads=torch_threads)


def actor_placement(parallel: ParallelConfig, *, cuda: bool) -> GroupPlacement:
    """The actor's ranks: one GPU each on CUDA machines; on CPU no reserved Ray CPU (the
    ranks share the cores with the engines) and one torch thread per rank."""
    return GroupPlacement.uniform(
        parallel.num_actor_ranks,
        num_cpus=0.0,
        num_gpus=1.0 if cuda else 0.0,
        strategy=_RAY_STRATEGIES[parallel.ray_scheduling],
        torch_threads=1,
    )


def engine_placement(rollout: RolloutConfig, parallel: ParallelConfig, *, cuda: bool) -> GroupPlacement:
    """The rollout engines, colocated with the actor: on CPU one Ray CPU (and one torch
    thread) each; on CUDA machines no reserved resources (they share the actor's GPUs)."""
    num_cpus = 0.0 if cuda else 1.0
    return GroupPlacement.uniform(
        rollout.num_engines,
        num_cpus=num_cpus,
        num_gpus=0.0,
        strategy=_RAY_STRATEGIES[parallel.ray_scheduling],
        torch_threads=max(1, int(num_cpus)),
    )


def spread_strategies(count: int, *, num_cpus: float = 0.0, num_gpus: float = 0.0) -> list[Any]:
    """One Ray scheduling strategy per member of a group of ``count`` (``ray.init`` must have run).

    Deterministic: member ``i`` is pinned to node ``i * n // count`` of the ``n`` alive
    nodes, ordered by IP then node id. Contiguous blocks keep neighbouring members (the
    ranks of one TP group) on one node, and with ``count >= n`` every node gets work. The
    pin is hard (Ray's node affinity with ``soft=False``): Ray's own ``SPREAD`` and soft
    affinity are best effort, and in our tests both put actors that reserve no resources
    on one node. A block that needs more CPUs or GPUs than its node has raises
    ``ValueError`` (it would wait forever).
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = sorted((n for n in ray.nodes() if n["Alive"]), key=lambda n: (n["NodeManagerAddress"], n["NodeID"]))
    chosen = [nodes[i * len(nodes) // count] for i in range(count)]
    for node in nodes:
        block = sum(1 for c in chosen if c is node)
        have = node["Resources"]
        if block * num_cpus > have.get("CPU", 0) or block * num_gpus > have.get("GPU", 0):
            raise ValueError(
                f"SPREAD placement: node {node['NodeManagerAddress']} ({node['NodeID'][:8]}) would get {block} "
                f"actor(s) needing {num_cpus:g} CPU and {num_gpus:g} GPU each, but has "
                f"{have.get('CPU', 0):g} CPU and {have.get('GPU', 0):g} GPU"
            )
    return [NodeAffinitySchedulingStrategy(node["NodeID"], soft=False) for node in chosen]


def write_placement(
    path: Path, *, ray_scheduling: str, actor_nodes: list[str], engine_nodes: list[str | None]
) -> None:
    """Record the Ray node of every actor rank and engine, and the cluster's live nodes:
    on a multi-node run it shows where the work went."""
    import ray

    nodes = {
        n["NodeID"]: {"ip": n["NodeManagerAddress"], "hostname": n["NodeManagerHostname"]}
        for n in ray.nodes()
        if n["Alive"]
    }
    placement = {
        "ray_scheduling": ray_scheduling,
        "actor_ranks": actor_nodes,
        "engines": engine_nodes,
        "nodes": nodes,
    }
    path.write_text(json.dumps(placement, indent=2) + "\n")
