"""A Ray pool of two real vLLM engines: dispatch, weight sync, an engine killed mid-rollout,
and no vLLM process left behind.

The engines are :class:`~tests.helpers.rollout_engines.FaultOnceVLLMEngine`: the real
``VLLMEngine`` whose Ray actor process exits (``os._exit``) on its first request after a
file is armed, which is what a crashed engine looks like to the pool. On CPU each engine
runs vLLM's worker in its actor's process (``own_process``): no vLLM process of its own.
"""

import pytest
import torch

from megatron_rl.cluster.placement import GroupPlacement
from megatron_rl.config.rollout import PoolConfig, RolloutConfig
from megatron_rl.rollout import RolloutPool, SamplingParams
from megatron_rl.weight_sync.buckets import MIB, make_buckets
from megatron_rl.weight_sync.meta import TensorMeta
from tests.helpers.processes import wait_gone
from tests.helpers.rollout_models import (
    VLLM_MODEL as MODEL,
)
from tests.helpers.rollout_models import (
    build_qwen2,
    hf_state,
    reference_logprobs,
    save_qwen2,
    vllm_engine_args,
)
from tests.ray_cluster import shared_ray

ray = pytest.importorskip("ray")

PROMPTS = [[1, 2, 3], [5] * 9, [7, 8], list(range(20, 37)), [3], [9, 9, 1, 4]]
PARAMS = SamplingParams(n=3, temperature=0.7, max_new_tokens=10, seed=17)


def _ids(results):
    return [[c.token_ids for c in group] for group in results]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_pool")
    a, b = save_qwen2(root / "a", seed=0, **MODEL), save_qwen2(root / "b", seed=7, **MODEL)
    shared_ray("vllm")
    config = RolloutConfig(
        engine="tests.helpers.rollout_engines:FaultOnceVLLMEngine",
        engine_args={"arm_file": str(root / "arm"), **vllm_engine_args()},
        num_engines=2,
        pool=PoolConfig(restart_timeout_s=300, request_timeout_s=300),
    )
    pool = RolloutPool(config, str(a), placement=GroupPlacement.uniform(2, num_cpus=1), weight_backend="gloo")
    try:
        yield pool, a, b, root / "arm"
    finally:
        pids = [p for h in pool.health() if h.get("ok") for p in (h["pid"], *h.get("child_pids", []))]
        pool.shutdown()
        assert not wait_gone(pids), "engine processes outlived the pool"


def test_sync_then_both_engines_serve_the_new_weights(setup):
    pool, _, b, _ = setup
    state = hf_state(b)
    metas = [TensorMeta.of(name, tensor) for name, tensor in state.items()]
    stats = pool.sync(make_buckets(state.items(), MIB // 4), version=1, metas=metas)
    assert stats["weight_sync/num_buckets"] > 1 and stats["weight_sync/num_engines"] == 2
    health = pool.health()
    assert all(h["weight_version"] == 1 and h["backend"] == "vllm" for h in health)
    if not torch.cuda.is_available():  # the worker in the actor's process: the host tensors went to it directly
        assert all(h["distributed_executor_backend"] == "uni" and not h["child_pids"] for h in health), health
    results = pool.generate(PROMPTS, PARAMS)
    assert {c.engine for g in results for c in g} == {"rollout-0", "rollout-1"}  # both engines served
    model = build_qwen2(7, **MODEL)
    for prompt, group in zip(PROMPTS, results):
        for c in group:
            assert c.weight_version == 1
            ref = reference_logprobs(model, prompt, c.token_ids, PARAMS.temperature)
            assert (ref - torch.tensor(c.logprobs)).abs().max().item() <= 1e-4


def test_engine_killed_mid_rollout_is_restarted_with_current_weights(setup):
    pool, _, _, arm = setup
    expected = pool.generate(PROMPTS, PARAMS)
    before = {h["engine"]: h for h in pool.health()}
    arm.write_text("exit")  # the first engine to get a request exits
    results = pool.generate(PROMPTS, PARAMS)
    assert not arm.exists()
    assert pool.last_stats["rollout/num_retries"] == 1
    # nothing lost or duplicated: the same completions, each prompt's group once, in order
    assert _ids(results) == _ids(expected)
    assert all(c.weight_version == 1 for g in results for c in g)
    after = {h["engine"]: h for h in pool.health()}
    assert all(h["ok"] and h["weight_version"] == 1 for h in after.values())
    crashed = [name for name in before if after[name]["pid"] != before[name]["pid"]]
    assert len(crashed) == 1
    # the crashed actor and any vLLM process of its own are gone
    assert not wait_gone([before[crashed[0]]["pid"], *before[crashed[0]]["child_pids"]])


def test_a_kept_engine_rebuilt_in_its_process_serves_its_checkpoint(setup):
    """What a kept engine handed to the next run goes through (``EngineWorker.reset``,
    ``loop.warm``): a second engine built in the same actor process, where on CPU vLLM's
    worker of the first one ran too. It must start and serve the checkpoint it was built
    from. (Last in the module: the pool is not told its engine went back to version 0.)"""
    pool, _, _, _ = setup
    actor = pool.actors[0]
    pid = ray.get(actor.health.remote())["pid"]
    health = ray.get(actor.reset.remote(), timeout=300)
    assert health["pid"] == pid and health["weight_version"] == 0
    if not torch.cuda.is_available():
        assert health["distributed_executor_backend"] == "uni" and not health["child_pids"], health
    results = ray.get(actor.generate.remote(PROMPTS, PARAMS, list(range(len(PROMPTS)))), timeout=300)
    model = build_qwen2(0, **MODEL)  # checkpoint a, the pool's start
    for prompt, group in zip(PROMPTS, results):
        for c in group:
            ref = reference_logprobs(model, prompt, c.token_ids, PARAMS.temperature)
            assert (ref - torch.tensor(c.logprobs)).abs().max().item() <= 1e-4
