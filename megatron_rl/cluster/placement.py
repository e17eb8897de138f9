"""Every Ray placement decision of a run: where actor ranks and rollout engines run.

A group of Ray actors (the actor's ranks, the rollout engines) is placed by a
:class:`GroupPlacement`: one set of Ray options per member (CPUs, GPUs, scheduling
strategy), the torch thread count of its processes, and, for engines that span several
GPUs, the devices it must see. The builder asks this module for both groups; the actor
group and the rollout pool only apply what they are given.

**GPU clusters** (Ray reports GPUs; real or, in tests, declared with ``--num-gpus``):

1. :func:`plan_gpu_placement` (pure, no process started) maps every actor rank and
   engine GPU to a node-local GPU slot. Actor ranks fill nodes in whole TP groups
   (consecutive ranks, as megatron orders TP fastest), so no TP group spans nodes;
   ``parallel.ray_scheduling: spread`` deals the TP groups out evenly over the nodes
   instead of filling the first ones. Engines take exactly ``rollout.tensor_parallel_size``
   GPUs of one node: with ``rollout.placement: colocated`` engine ``e`` shares the GPUs of
   actor ranks ``[e*t, (e+1)*t)`` (time-shared: fractional Ray GPUs); with
   ``disaggregated`` the engines get the GPUs the actor left free, first fit. A layout
   that does not fit raises :class:`PlacementError` naming the numbers, before anything
   starts.
2. :func:`place_on_gpus` creates one Ray placement group per node (one ``{"GPU": 1}``
   bundle per slot, pinned to the node by its ``ray.io/node-id`` label), reads each
   bundle's GPU id, and returns the two groups' placements plus the map written to
   ``RUN_DIR/placement.json``.

**CPU clusters**: the actor ranks reserve no Ray CPU and each engine one, so a 2-core
machine runs one actor rank and one engine side by side (time-sliced);
``parallel.ray_scheduling: spread`` pins contiguous blocks of each group to the alive
nodes (:func:`spread_strategies`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_rl.config.parallel import ParallelConfig
from megatron_rl.config.rollout import RolloutConfig

__all__ = [
    "GroupPlacement",
    "NodeInfo",
    "PlacementError",
    "PlacementPlan",
    "RunPlacement",
    "actor_placement",
    "cpu_threads",
    "alive_nodes",
    "engine_placement",
    "place_on_gpus",
    "plan_gpu_placement",
    "spread_strategies",
    "write_placement",
]

_RAY_STRATEGIES = {"default": "DEFAULT", "spread": "SPREAD"}


class PlacementError(ValueError):
    """The run's actor ranks and engines do not fit the Ray cluster (the message has the numbers)."""


@dataclass(frozen=True)
class GroupPlacement:
    """Where each member of a group of Ray actors runs."""

    ray_options: tuple[dict[str, Any], ...]
    """Per member: the Ray actor options ``num_cpus``, ``num_gpus`` and
    ``scheduling_strategy``."""

    torch_threads: int = 1
    """torch intra-op threads of each member process on CPU."""

    visible_devices: tuple[tuple[str, ...] | None, ...] = ()
    """Per member (or empty: none): the GPU ids its process must see, when they are more
    than Ray's own assignment (an engine over several colocated GPUs)."""

    def __len__(self) -> int:
        return len(self.ray_options)

    def devices_of(self, member: int) -> tuple[str, ...] | None:
        return self.visible_devices[member] if self.visible_devices else None

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


# ---------------------------------------------------------------------------- GPU plan


@dataclass(frozen=True)
class NodeInfo:
    """One alive Ray node."""

    node_id: str
    ip: str
    num_gpus: int
    num_cpus: int = 0
    """Ray CPUs of the node."""


@dataclass(frozen=True)
class PlacementPlan:
    """Node-local GPU slots of every actor rank and engine (see the module docstring)."""

    nodes: tuple[NodeInfo, ...]
    actor_slots: tuple[tuple[int, int], ...]
    """Per actor rank: (node index, slot on that node)."""
    engine_slots: tuple[tuple[tuple[int, int], ...], ...]
    """Per engine: the (node index, slot) of each of its GPUs."""
    colocated: bool

    def slots_by_node(self) -> dict[int, list[int]]:
        """Every slot in use, per node index (sorted)."""
        used: dict[int, set[int]] = {}
        for node, slot in [*self.actor_slots, *(s for engine in self.engine_slots for s in engine)]:
            used.setdefault(node, set()).add(slot)
        return {node: sorted(slots) for node, slots in sorted(used.items())}


def plan_gpu_placement(parallel: ParallelConfig, rollout: RolloutConfig, nodes: list[NodeInfo]) -> PlacementPlan:
    """Map actor ranks and engines onto the GPUs of ``nodes`` (see the module docstring).

    Raises:
        PlacementError: the layout does not fit; the message names what is needed and
            what each node has.
    """
    tp = parallel.tensor_model_parallel_size
    ranks = parallel.num_actor_ranks
    etp, engines = rollout.tensor_parallel_size, rollout.num_engines
    colocated = rollout.placement == "colocated"
    have = [n.num_gpus for n in nodes]
    need = f"{ranks} actor ranks in TP groups of {tp}"
    need += (
        f" with {engines} colocated engine(s) of {etp} GPU(s) on their GPUs"
        if colocated
        else f" and {engines} engine(s) of {etp} GPU(s) on GPUs of their own"
    )

    def fail(why: str) -> PlacementError:
        return PlacementError(f"placement: {need} do not fit the Ray cluster ({why}); nodes have {have} GPUs")

    groups = ranks // tp
    capacity = [g // tp for g in have]  # whole TP groups per node
    if sum(capacity) < groups:
        raise fail(f"the actor needs {ranks} GPUs in whole TP groups of {tp}; the nodes hold {sum(capacity)} groups")
    quota = list(capacity)
    if parallel.ray_scheduling == "spread":
        used_nodes = [i for i, c in enumerate(capacity) if c > 0]
        per = math.ceil(groups / len(used_nodes))
        quota = [min(c, per) if i in used_nodes else 0 for i, c in enumerate(capacity)]
        while sum(quota) < groups:  # uneven nodes: top up the ones with room left
            i = next(i for i, (q, c) in enumerate(zip(quota, capacity)) if q < c)
            quota[i] += 1
    actor_slots: list[tuple[int, int]] = []
    next_free = [0] * len(nodes)
    for node, q in enumerate(quota):
        take = min(q, groups - len(actor_slots) // tp) * tp
        actor_slots += [(node, next_free[node] + j) for j in range(take)]
        next_free[node] += take

    engine_slots: list[tuple[tuple[int, int], ...]] = []
    if colocated:
        if engines * etp > ranks:
            raise fail(f"colocated engines need {engines * etp} GPUs but the actor has {ranks}")
        for e in range(engines):
            slots = tuple(actor_slots[e * etp : (e + 1) * etp])
            if len({node for node, _ in slots}) != 1:
                raise fail(f"engine {e}'s {etp} GPUs would span nodes (actor ranks {e * etp}..{(e + 1) * etp - 1})")
            engine_slots.append(slots)
    else:
        if rollout.engine_gpus != engines * etp:  # RolloutConfig checks it too; the plan relies on it
            raise fail(f"rollout.num_gpus={rollout.engine_gpus} is not num_engines x tensor_parallel_size")
        for e in range(engines):
            node = next((i for i, g in enumerate(have) if g - next_free[i] >= etp), None)
            if node is None:
                left = [g - f for g, f in zip(have, next_free)]
                raise fail(f"engine {e} needs {etp} free GPUs on one node; after the actor and engines 0..{e - 1} "
                           f"the nodes have {left} free")  # fmt: skip
            engine_slots.append(tuple((node, next_free[node] + j) for j in range(etp)))
            next_free[node] += etp
    return PlacementPlan(
        nodes=tuple(nodes), actor_slots=tuple(actor_slots), engine_slots=tuple(engine_slots), colocated=colocated
    )


def alive_nodes() -> list[NodeInfo]:
    """The cluster's alive nodes, ordered by IP then node id (``ray.init`` must have run)."""
    import ray

    nodes = sorted((n for n in ray.nodes() if n["Alive"]), key=lambda n: (n["NodeManagerAddress"], n["NodeID"]))
    return [
        NodeInfo(n["NodeID"], n["NodeManagerAddress"], int(n["Resources"].get("GPU", 0)), int(n["Resources"].get("CPU", 0)))
        for n in nodes
    ]


@dataclass
class RunPlacement:
    """The placement groups of a run and where they put each member."""

    actor: GroupPlacement
    engines: GroupPlacement
    layout: dict[str, Any]
    """The map written to ``placement.json``: per rank and engine its node and GPU ids."""
    placement_groups: list[Any] = field(default_factory=list)

    def remove(self) -> None:
        """Release the placement groups (after the run's actors are gone)."""
        from ray.util import remove_placement_group

        for pg in self.placement_groups:
            remove_placement_group(pg)
        self.placement_groups = []


def place_on_gpus(plan: PlacementPlan, *, timeout_s: float = 300.0, torch_threads: int = 1) -> RunPlacement:
    """Create the plan's placement groups and the two groups' Ray options (``torch_threads``
    per actor rank and engine).

    Actor ranks take 1 GPU of their bundle (0.5 when engines share it); an engine takes
    its first GPU's bundle (1 GPU, or 0.5 colocated) and sees all of its GPUs through
    ``visible_devices``.
    """
    import ray
    from ray.util import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    slots = plan.slots_by_node()
    groups: dict[int, Any] = {}
    bundle_of: dict[tuple[int, int], int] = {}
    for node, node_slots in slots.items():
        node_id = plan.nodes[node].node_id
        groups[node] = placement_group(
            [{"GPU": 1.0}] * len(node_slots),
            strategy="STRICT_PACK",
            bundle_label_selector=[{"ray.io/node-id": node_id}] * len(node_slots),
        )
        for index, slot in enumerate(node_slots):
            bundle_of[(node, slot)] = index
    try:
        ray.get([pg.ready() for pg in groups.values()], timeout=timeout_s)
    except Exception as exc:
        for pg in groups.values():
            ray.util.remove_placement_group(pg)
        raise PlacementError(f"placement groups for {sorted(slots.items())} did not become ready: {exc}") from exc

    def strategy(node: int, slot: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(groups[node], placement_group_bundle_index=bundle_of[(node, slot)])

    @ray.remote(num_cpus=0, num_gpus=0.01)
    def _gpu_id() -> str:
        return str(ray.get_gpu_ids()[0])

    gpu_ids = dict(zip(bundle_of, ray.get([_gpu_id.options(scheduling_strategy=strategy(*k)).remote() for k in bundle_of])))
    share = 0.5 if plan.colocated else 1.0
    actor = GroupPlacement(
        ray_options=tuple(
            {"num_cpus": 0, "num_gpus": share, "scheduling_strategy": strategy(*s)} for s in plan.actor_slots
        ),
        torch_threads=torch_threads,
    )
    engines = GroupPlacement(
        ray_options=tuple(
            {"num_cpus": 0, "num_gpus": share, "scheduling_strategy": strategy(*e[0])} for e in plan.engine_slots
        ),
        visible_devices=tuple(tuple(gpu_ids[s] for s in e) for e in plan.engine_slots),
        torch_threads=torch_threads,
    )
    layout = {
        "kind": "gpu",
        "colocated": plan.colocated,
        "actor_ranks": [{"node": plan.nodes[n].node_id, "gpu": gpu_ids[(n, s)]} for n, s in plan.actor_slots],
        "engines": [
            {"node": plan.nodes[e[0][0]].node_id, "gpus": [gpu_ids[s] for s in e]} for e in plan.engine_slots
        ],
    }
    return RunPlacement(actor=actor, engines=engines, layout=layout, placement_groups=list(groups.values()))


# ---------------------------------------------------------------------------- CPU


def cpu_threads(parallel: ParallelConfig, rollout: RolloutConfig, nodes: list[NodeInfo]) -> int:
    """Torch threads per actor rank and per engine: ``parallel.cpu_threads``, else 1 on a
    GPU cluster (the device does the work), else the smallest node's CPUs over the larger
    group when the two groups take turns, or over both groups together when they work
    at once (``rollout.max_staleness`` >= 1: generation runs during the update)."""
    if parallel.cpu_threads is not None:
        return parallel.cpu_threads
    if any(n.num_gpus for n in nodes):
        return 1
    cores = min((n.num_cpus for n in nodes), default=1)
    if rollout.max_staleness > 0:
        return max(1, cores // (parallel.num_actor_ranks + rollout.num_engines))
    return max(1, cores // max(parallel.num_actor_ranks, rollout.num_engines, 1))


def actor_placement(parallel: ParallelConfig, *, torch_threads: int = 1) -> GroupPlacement:
    """The actor's ranks on a CPU cluster: no reserved Ray CPU (the ranks share the cores
    with the engines) and ``torch_threads`` each (:func:`cpu_threads`)."""
    return GroupPlacement.uniform(
        parallel.num_actor_ranks, num_cpus=0.0, strategy=_RAY_STRATEGIES[parallel.ray_scheduling],
        torch_threads=torch_threads,
    )  # fmt: skip


def engine_placement(rollout: RolloutConfig, parallel: ParallelConfig, *, torch_threads: int = 1) -> GroupPlacement:
    """The rollout engines on a CPU cluster: one Ray CPU and ``torch_threads`` each."""
    return GroupPlacement.uniform(
        rollout.num_engines, num_cpus=1.0, strategy=_RAY_STRATEGIES[parallel.ray_scheduling],
        torch_threads=torch_threads,
    )  # fmt: skip


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


def write_placement(path: Path, *, ray_scheduling: str, actor_nodes: list[str], engine_nodes: list[str | None],
                    layout: dict[str, Any] | None = None) -> None:  # fmt: skip
    """Record where every actor rank and engine runs (node, and GPU ids on GPU clusters)
    and the cluster's live nodes: on a multi-node run it shows where the work went."""
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
        **({"gpu_layout": layout} if layout else {}),
    }
    path.write_text(json.dumps(placement, indent=2) + "\n")
