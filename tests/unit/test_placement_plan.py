"""The GPU placement plan (``placement.plan_gpu_placement``): pure, no Ray.

2 nodes x 8 GPUs, actor TP 2 and 4, colocated and disaggregated engines: no TP group spans
nodes, each engine's GPUs are on one node, colocated engines sit on their actor ranks'
GPUs, disaggregated ones on GPUs of their own; a layout that does not fit fails naming
the numbers."""

import pytest

from megatron_rl.cluster.placement import NodeInfo, PlacementError, cpu_threads, plan_gpu_placement
from megatron_rl.config.parallel import ParallelConfig
from megatron_rl.config.rollout import RolloutConfig

NODES = [NodeInfo("n0", "10.0.0.1", 8), NodeInfo("n1", "10.0.0.2", 8)]


def _plan(ranks, tp, engines, etp, placement, **parallel):
    par = ParallelConfig(num_actor_ranks=ranks, tensor_model_parallel_size=tp, **parallel)
    extra = {"num_gpus": engines * etp} if placement == "disaggregated" else {}
    roll = RolloutConfig(num_engines=engines, tensor_parallel_size=etp, placement=placement, **extra)
    return plan_gpu_placement(par, roll, NODES)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("placement", ["colocated", "disaggregated"])
def test_tp_groups_and_engines_stay_within_a_node(tp, placement):
    ranks = 8 if placement == "disaggregated" else 16
    engines = (16 - ranks) // tp if placement == "disaggregated" else 16 // tp  # every GPU in use
    plan = _plan(ranks, tp, engines, tp, placement)
    assert len(plan.actor_slots) == ranks and len(set(plan.actor_slots)) == ranks
    for g in range(ranks // tp):  # consecutive ranks form a TP group (megatron's order)
        assert len({node for node, _ in plan.actor_slots[g * tp : (g + 1) * tp]}) == 1
    for e, slots in enumerate(plan.engine_slots):
        assert len(slots) == tp and len({node for node, _ in slots}) == 1
        if placement == "colocated":
            assert slots == plan.actor_slots[e * tp : (e + 1) * tp]
    if placement == "disaggregated":
        engine_gpus = {s for e in plan.engine_slots for s in e}
        assert not engine_gpus & set(plan.actor_slots) and len(engine_gpus) == 8
    used = plan.slots_by_node()
    assert all(max(slots) < 8 for slots in used.values())


def test_spread_deals_tp_groups_over_the_nodes():
    packed = _plan(8, 2, 1, 2, "colocated")
    spread = _plan(8, 2, 1, 2, "colocated", ray_scheduling="spread")
    assert {n for n, _ in packed.actor_slots} == {0}
    assert [n for n, _ in spread.actor_slots] == [0, 0, 0, 0, 1, 1, 1, 1]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ((24, 2, 1, 2, "colocated"), "the actor needs 24 GPUs"),
        ((20, 4, 1, 4, "colocated"), "whole TP groups of 4"),
        ((8, 2, 3, 4, "disaggregated"), "engine 2 needs 4 free GPUs on one node"),
        ((4, 2, 3, 2, "colocated"), "colocated engines need 6 GPUs but the actor has 4"),
    ],
)
def test_a_layout_that_does_not_fit_names_the_numbers(args, needle):
    with pytest.raises(PlacementError, match=needle) as info:
        _plan(*args)
    assert "nodes have [8, 8] GPUs" in str(info.value)


def test_cpu_threads_default_shares_the_smallest_node_between_the_larger_group():
    def threads(cpus, ranks, engines, **parallel):
        nodes = [NodeInfo(f"n{i}", f"10.0.0.{i}", 0, c) for i, c in enumerate(cpus)]
        return cpu_threads(ParallelConfig(num_actor_ranks=ranks, **parallel), RolloutConfig(num_engines=engines), nodes)

    assert threads([2], 1, 1) == 2  # the actor and the engine take turns: each may use both cores
    assert threads([16, 8], 2, 1) == 4  # the smallest node, the larger group
    assert threads([16], 2, 4) == 4
    assert threads([2], 4, 1) == 1  # never below 1
    assert threads([], 1, 1) == 1
    assert threads([16], 1, 1, cpu_threads=3) == 3  # set explicitly: used as given
    both_busy = RolloutConfig(num_engines=1, placement="disaggregated", max_staleness=1, tis_cap=2.0)
    assert cpu_threads(ParallelConfig(), both_busy, [NodeInfo("n0", "10.0.0.0", 0, 2)]) == 1  # generation overlaps
    assert cpu_threads(ParallelConfig(num_actor_ranks=2), both_busy, [NodeInfo("n0", "10.0.0.0", 0, 16)]) == 5
    gpu_nodes = [NodeInfo("g0", "10.0.1.0", 8, 64)]
    parallel, rollout = ParallelConfig(), RolloutConfig()
    assert cpu_threads(parallel, rollout, gpu_nodes) == 1  # GPUs do the work: one thread per process
    assert cpu_threads(ParallelConfig(cpu_threads=4), rollout, gpu_nodes) == 4
