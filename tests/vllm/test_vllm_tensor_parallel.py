"""A tensor-parallel vLLM engine (``rollout.tensor_parallel_size: 2``) placed as on GPUs.

The engine's Ray actor is created inside the project's placement groups on a Ray cluster
with fake GPUs (``cluster.placement.place_on_gpus``), colocated with two actor ranks'
bundles (disaggregated placement differs only in which bundles: ``test_gpu_placement``;
a disaggregated TP=2 run trains in ``test_vllm_trainer``). Inside a placement group vLLM
would pick its Ray executor, whose workers ask for GPU bundles the actor ranks hold; the engine sets ``mp`` and, on
CPU, binds each worker to a core (vLLM's automatic binding needs one NUMA node per worker,
which this machine does not have). Checked: both workers run, the engine's log-probs match
a float32 ``transformers`` forward before and after a weight update (host tensors into both
workers over the engine's own gloo group, then the collective path: a gloo sender standing
for NCCL's, into the pool's client), and no vLLM process outlives the pool.
"""

import pytest
import torch

from megatron_rl.cluster.placement import alive_nodes, place_on_gpus, plan_gpu_placement
from megatron_rl.config.parallel import ParallelConfig
from megatron_rl.config.rollout import PoolConfig, RolloutConfig
from megatron_rl.rollout import RolloutPool, SamplingParams
from megatron_rl.weight_sync.buckets import MIB, make_buckets
from megatron_rl.weight_sync.meta import TensorMeta
from megatron_rl.weight_sync.transports.gloo import GlooInitInfo, GlooSender, free_port
from tests.helpers import rollout_models as models
from tests.helpers.processes import wait_gone
from tests.helpers.rollout_models import VLLM_MODEL as MODEL
from tests.ray_cluster import shared_ray

ray = pytest.importorskip("ray")

PROMPTS = [[1, 2, 3], [5] * 9, [7, 8, 9, 10, 11]]
PARAMS = SamplingParams(n=2, temperature=0.8, max_new_tokens=8, seed=3)


def _assert_matches(results, seed):
    model = models.build_qwen2(seed, **MODEL)
    worst = 0.0
    for prompt, group in zip(PROMPTS, results):
        for c in group:
            ref = models.reference_logprobs(model, prompt, c.token_ids, PARAMS.temperature)
            worst = max(worst, (ref - torch.tensor(c.logprobs)).abs().max().item())
    assert worst <= 1e-4, f"vLLM TP=2 vs transformers: max |dlogp| {worst}"


def test_tp2_engine_in_placement_groups_serves_and_takes_weights(tmp_path):
    a, b = models.save_qwen2(tmp_path / "a", seed=0, **MODEL), models.save_qwen2(tmp_path / "b", seed=7, **MODEL)
    shared_ray("vllm")
    assert [n.num_gpus for n in alive_nodes()] == [4]
    rollout = RolloutConfig(
        engine="vllm", engine_args=models.vllm_engine_args(), num_engines=1, tensor_parallel_size=2, placement="colocated",
        pool=PoolConfig(restart_timeout_s=300, request_timeout_s=300),
    )  # fmt: skip
    plan = plan_gpu_placement(ParallelConfig(num_actor_ranks=2), rollout, alive_nodes())
    run = place_on_gpus(plan, timeout_s=60)
    pool = None
    try:
        pool = RolloutPool(rollout, str(a), placement=run.engines, weight_backend="gloo")
        (health,) = pool.health()
        gpus = run.layout["engines"][0]["gpus"]
        assert health["distributed_executor_backend"] == "mp"
        assert health["weight_receivers"] == 2
        assert ray.get(pool.actors[0].gpu_ids.remote())["cuda_visible_devices"] == ",".join(gpus)
        assert gpus == [r["gpu"] for r in run.layout["actor_ranks"]]  # colocated: the actor ranks' GPUs
        _assert_matches(pool.generate(PROMPTS, PARAMS), seed=0)

        # Host tensors (object-store buckets) into both workers.
        state = models.hf_state(b)
        metas = [TensorMeta.of(n, t) for n, t in state.items()]
        pool.sync(make_buckets(state.items(), MIB // 4), version=1, metas=metas)
        _assert_matches(pool.generate(PROMPTS, PARAMS), seed=7)

        # The collective path: a sender outside the engine, both workers in its group.
        state = models.hf_state(a)
        metas = [TensorMeta.of(n, t) for n, t in state.items()]
        client = pool.client()
        assert client.world_size == 3
        engines = pool.begin_update(2, metas)
        info = GlooInitInfo(master_address="127.0.0.1", master_port=free_port(), world_size=client.world_size)
        sender = GlooSender.trainer_init(info, client=client, source=models.StateSource(state))
        try:
            sender.send_weights()
        finally:
            sender.shutdown()
        pool.commit_update(2, engines)
        _assert_matches(pool.generate(PROMPTS, PARAMS), seed=0)
        children = health["child_pids"]
        assert len(children) >= 3  # engine core and two workers
    finally:
        if pool is not None:
            pool.shutdown()
        run.remove()
    left = wait_gone(children)
    assert not left, f"vLLM processes outlived the pool: {left}"
