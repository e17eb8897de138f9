"""Placement on a 2-node Ray cluster with fake GPUs (``ray.cluster_utils.Cluster``, 4 GPUs
per node): the placement groups put each actor rank and engine on the node and GPU the
plan says, no TP group spans nodes, and an engine process sees exactly its GPU ids
(``EngineWorker`` sets ``CUDA_VISIBLE_DEVICES`` from the plan); a config that does not fit
fails before any placement group or process is created."""

import pytest

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from megatron_rl.cluster.placement import PlacementError, alive_nodes, place_on_gpus, plan_gpu_placement  # noqa: E402
from megatron_rl.config.parallel import ParallelConfig  # noqa: E402
from megatron_rl.config.rollout import RolloutConfig
from megatron_rl.rollout.pool.worker import EngineWorker  # noqa: E402
from tests.helpers.rollout_models import save_qwen2  # noqa: E402
from tests.ray_cluster import release_ray  # noqa: E402


@pytest.fixture(scope="module")
def cluster():
    release_ray()  # a fake 2-node GPU cluster of its own
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 4})
    c.add_node(num_cpus=2, num_gpus=4)
    ray.init(address=c.address, include_dashboard=False, log_to_driver=False)
    c.wait_for_nodes()
    yield c
    ray.shutdown()
    c.shutdown()


@ray.remote(num_cpus=0)
def _where():
    import os

    return ray.get_runtime_context().get_node_id(), [str(g) for g in ray.get_gpu_ids()], os.environ.get(
        "CUDA_VISIBLE_DEVICES")  # fmt: skip


def _probe(options):
    return ray.get(_where.options(**options).remote())


@pytest.mark.parametrize(
    ("tp", "placement", "ranks", "engines"),
    [(2, "colocated", 8, 4), (4, "colocated", 8, 2), (2, "disaggregated", 4, 2), (4, "disaggregated", 4, 1)],
)
def test_ranks_and_engines_land_where_the_plan_says(cluster, tp, placement, ranks, engines):
    nodes = alive_nodes()
    assert [n.num_gpus for n in nodes] == [4, 4]
    extra = {"num_gpus": engines * tp} if placement == "disaggregated" else {}
    plan = plan_gpu_placement(
        ParallelConfig(num_actor_ranks=ranks, tensor_model_parallel_size=tp),
        RolloutConfig(num_engines=engines, tensor_parallel_size=tp, placement=placement, **extra),
        nodes,
    )
    run = place_on_gpus(plan, timeout_s=60)
    try:
        actor = [_probe(o) for o in run.actor.ray_options]
        for rank, (node, gpus, _) in enumerate(actor):
            assert node == run.layout["actor_ranks"][rank]["node"]
            assert gpus == [run.layout["actor_ranks"][rank]["gpu"]]
        for g in range(ranks // tp):
            assert len({node for node, _, _ in actor[g * tp : (g + 1) * tp]}) == 1, "a TP group spans nodes"
        assert len({(node, gpus[0]) for node, gpus, _ in actor}) == ranks  # one GPU per rank
        for e, options in enumerate(run.engines.ray_options):
            node, gpus, _ = _probe(options)
            want = run.layout["engines"][e]
            assert node == want["node"] and gpus == want["gpus"][:1] and len(want["gpus"]) == tp
            assert list(run.engines.devices_of(e)) == want["gpus"]
            if placement == "colocated":  # on its actor ranks' GPUs
                assert want["gpus"] == [r["gpu"] for r in run.layout["actor_ranks"][e * tp : (e + 1) * tp]]
            else:
                taken = {(r["node"], r["gpu"]) for r in run.layout["actor_ranks"]}
                assert not taken & {(want["node"], g) for g in want["gpus"]}
    finally:
        run.remove()


def test_engine_process_sees_exactly_its_gpus(cluster, tmp_path):
    plan = plan_gpu_placement(
        ParallelConfig(num_actor_ranks=4, tensor_model_parallel_size=2),
        RolloutConfig(num_engines=2, tensor_parallel_size=2, placement="disaggregated", num_gpus=4),
        alive_nodes(),
    )
    run = place_on_gpus(plan, timeout_s=60)
    model = save_qwen2(tmp_path / "m", seed=0)
    workers = []
    try:
        for e, options in enumerate(run.engines.ray_options):
            worker = ray.remote(EngineWorker).options(**options).remote(
                "hf", str(model), {}, f"e{e}", 1, "object_store", run.engines.devices_of(e)
            )  # fmt: skip
            workers.append(worker)
            seen = ray.get(worker.gpu_ids.remote())
            want = run.layout["engines"][e]["gpus"]
            assert seen["cuda_visible_devices"] == ",".join(want)
            assert seen["ray_gpu_ids"] == want[:1]  # Ray's own share: the first GPU's bundle
            assert ray.get(worker.node_id.remote()) == run.layout["engines"][e]["node"]
    finally:
        for worker in workers:
            ray.kill(worker)
        run.remove()


def test_oversized_config_fails_before_anything_starts(cluster):
    from ray.util import placement_group_table

    before = len(placement_group_table())
    with pytest.raises(PlacementError, match=r"nodes have \[4, 4\] GPUs"):
        plan_gpu_placement(
            ParallelConfig(num_actor_ranks=8, tensor_model_parallel_size=4),
            RolloutConfig(num_engines=1, tensor_parallel_size=4, placement="disaggregated", num_gpus=4),
            alive_nodes(),
        )
    assert len(placement_group_table()) == before
