"""The Ray rollout pool: ordering, seeds, weight sync, restarts and errors (2 HF engines, CPU).

One Ray instance and one 2-engine pool serve the whole module (starting them costs ~10 s).
The pool's engines are :class:`FaultOnceEngine` -- a real ``HFEngine`` that crashes or
hangs once when a file is armed -- so the failure tests need no second pool.
"""

import time

import pytest
import torch

ray = pytest.importorskip("ray")

from megatron_rl.cluster.placement import GroupPlacement  # noqa: E402
from megatron_rl.config.rollout import PoolConfig, RolloutConfig  # noqa: E402
from megatron_rl.rollout import RolloutEngineError, RolloutPool, SamplingParams  # noqa: E402
from megatron_rl.rollout.engines.hf import HFEngine  # noqa: E402
from megatron_rl.rollout.pool import recovery  # noqa: E402
from megatron_rl.rollout.pool.recovery import wait_until_back  # noqa: E402
from megatron_rl.weight_sync.buckets import MIB, make_buckets  # noqa: E402
from megatron_rl.weight_sync.meta import TensorMeta  # noqa: E402
from tests.helpers.rollout_models import build_qwen2, hf_state, reference_logprobs, save_qwen2  # noqa: E402
from tests.ray_cluster import shared_ray

PROMPTS = [[1, 2, 3], [5] * 9, [7, 8], list(range(20, 37)), [3], [9, 9, 1, 4]]
PARAMS = SamplingParams(n=3, temperature=0.7, max_new_tokens=10, seed=17)


@pytest.fixture(scope="module")
def ray_cluster():
    shared_ray("distributed")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout_pool")
    return save_qwen2(root / "a", seed=0), save_qwen2(root / "b", seed=7), root / "arm"


@pytest.fixture(scope="module")
def pool(ray_cluster, ckpts):
    # A request takes well under a second here; the 5 s (request) and 15 s (a bucket's load)
    # time-outs only matter for the hang tests.
    # The module kills one engine up to four times (which one the armed faults hit is a
    # race), more than the default max_restarts=3 allows.
    config = RolloutConfig(
        engine="tests.helpers.rollout_engines:FaultOnceEngine",
        engine_args={"arm_file": str(ckpts[2])},
        num_engines=2,
        pool=PoolConfig(restart_timeout_s=120, request_timeout_s=5, max_restarts=10, weight_sync_timeout_s=15),
    )
    pool = RolloutPool(config, str(ckpts[0]), placement=GroupPlacement.uniform(2, num_cpus=1))
    yield pool
    pool.shutdown()


def _ids(results):
    return [[c.token_ids for c in group] for group in results]


def test_results_in_prompt_order_grouped_and_tagged(pool):
    results = pool.generate(PROMPTS, PARAMS)
    assert [len(group) for group in results] == [PARAMS.n] * len(PROMPTS)
    # Log-probs recomputed from each group's own prompt match: groups are in prompt order.
    model = build_qwen2(0)
    for prompt, group in zip(PROMPTS, results):
        for c in group:
            ref = reference_logprobs(model, prompt, c.token_ids, PARAMS.temperature)
            assert (ref - torch.tensor(c.logprobs)).abs().max().item() <= 1e-4
            assert c.weight_version == 0
    # Two requests, one per engine, both engines used; a prompt's samples share an engine.
    assert pool.last_stats["rollout/num_requests"] == 2
    assert {c.engine for g in results for c in g} == set(pool.engine_names)
    assert all(len({c.engine for c in g}) == 1 for g in results)


def test_results_do_not_depend_on_the_request_split(pool, ckpts):
    results = pool.generate(PROMPTS, PARAMS)
    assert _ids(pool.generate(PROMPTS, PARAMS)) == _ids(results)  # same seed, same samples
    # One local engine serving everything in one batch draws the same samples.
    local = HFEngine(ckpts[0]).generate(PROMPTS, PARAMS)
    assert _ids(local) == _ids(results)
    other_seed = SamplingParams(n=3, temperature=0.7, max_new_tokens=10, seed=18)
    assert _ids(pool.generate(PROMPTS, other_seed)) != _ids(results)


def test_least_outstanding_work_dispatch(pool):
    # Six one-prompt requests; each engine holds at most 2 at a time, and the long prompt
    # (index 3) counts as more work, so dispatch alternates rather than filling one engine.
    pool.config.pool.max_prompts_per_request = 1
    try:
        results = pool.generate(PROMPTS, PARAMS)
    finally:
        pool.config.pool.max_prompts_per_request = None
    assert pool.last_stats["rollout/num_requests"] == len(PROMPTS)
    engines = [g[0].engine for g in results]
    assert engines[:2] == ["rollout-0", "rollout-1"]  # the first two go to the two idle engines
    assert set(engines) == set(pool.engine_names)


def test_weight_sync_equals_a_fresh_engine(pool, ckpts):
    state = hf_state(ckpts[1])
    metas = [TensorMeta.of(name, tensor) for name, tensor in state.items()]
    stats = pool.sync(make_buckets(state.items(), int(0.05 * MIB)), version=1, metas=metas)  # 50 KiB: many buckets
    assert stats["weight_sync/bytes"] == sum(t.numel() * t.element_size() for t in state.values())
    assert stats["weight_sync/num_tensors"] == len(state)
    assert stats["weight_sync/num_buckets"] > 3
    assert stats["weight_sync/num_engines"] == 2 and stats["weight_sync/version"] == 1
    assert pool.weight_version == 1
    assert all(h["weight_version"] == 1 for h in pool.health())
    results = pool.generate(PROMPTS, PARAMS)
    fresh = HFEngine(ckpts[1]).generate(PROMPTS, PARAMS)
    assert _ids(results) == _ids(fresh)
    assert all(c.weight_version == 1 for g in results for c in g)


@pytest.mark.parametrize("fault", ["exit", "hang"])
def test_failed_request_is_retried_on_the_restarted_engine_with_current_weights(pool, ckpts, fault):
    assert pool.weight_version == 1  # after the sync test: the restart must restore version 1
    expected = HFEngine(ckpts[1]).generate(PROMPTS, PARAMS)
    ckpts[2].write_text(fault)  # arm: the first engine to get a request exits / hangs
    results = pool.generate(PROMPTS, PARAMS)
    assert not ckpts[2].exists()
    assert pool.last_stats["rollout/num_retries"] == 1
    assert _ids(results) == _ids(expected)
    assert all(c.weight_version == 1 for g in results for c in g)
    assert all(h["ok"] and h["weight_version"] == 1 for h in pool.health())


def test_engine_restarted_between_calls_gets_current_weights(pool, ckpts):
    before = {h["engine"]: h["pid"] for h in pool.health()}
    ray.kill(pool.actors[1], no_restart=False)
    # Wait until Ray has restarted it: it now holds the initial checkpoint (version 0).
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        health = pool.health()[1]
        if health["ok"] and health["pid"] != before["rollout-1"]:
            break
        time.sleep(0.2)
    assert health["weight_version"] == 0
    results = pool.generate(PROMPTS, PARAMS)
    # Its stale completions were detected by their version tag, weights restored, request redone.
    assert pool.last_stats["rollout/num_retries"] == 1
    assert _ids(results) == _ids(HFEngine(ckpts[1]).generate(PROMPTS, PARAMS))
    assert all(c.weight_version == 1 for g in results for c in g)
    after = {h["engine"]: h["pid"] for h in pool.health()}
    assert after["rollout-0"] == before["rollout-0"]


def test_restart_returns_once_every_new_process_answers_with_current_weights(pool):
    # ray.kill is asynchronous: the dying process can still answer a call made right after
    # it. restart() returns only when a new process answers, restored to the pool's version,
    # so calls made right after it (a sync's retry) reach the new processes.
    before = {h["engine"]: h["pid"] for h in pool.health()}
    pool.restart([0, 1])
    health = pool.health()
    assert all(h["ok"] and h["weight_version"] == pool.weight_version == 1 for h in health), health
    assert all(h["pid"] != before[h["engine"]] for h in health), (before, health)
    pool.generate(PROMPTS, PARAMS)
    assert pool.last_stats["rollout/num_retries"] == 0


def test_sleep_and_wake(pool):
    pool.sleep()
    assert all(h["sleeping"] for h in pool.health())
    with pytest.raises(RolloutEngineError, match=r"rollout-\d raised on request \d/2"):
        pool.generate(PROMPTS, PARAMS)
    pool.wake()
    assert len(pool.generate(PROMPTS, PARAMS)) == len(PROMPTS)


def test_an_engine_that_dies_during_sleep_is_restarted_asleep_with_current_weights(pool, ckpts):
    before = {h["engine"]: h["pid"] for h in pool.health()}
    ckpts[2].write_text("sleep:exit")  # the first engine to go to sleep exits instead
    pool.sleep()
    assert not ckpts[2].exists()
    health = pool.health()
    assert all(h["ok"] and h["sleeping"] and h["weight_version"] == pool.weight_version == 1 for h in health), health
    assert sum(h["pid"] != before[h["engine"]] for h in health) == 1
    pool.wake()
    assert _ids(pool.generate(PROMPTS, PARAMS)) == _ids(HFEngine(ckpts[1]).generate(PROMPTS, PARAMS))


def test_an_engine_that_hangs_loading_a_bucket_is_restarted_with_the_synced_weights(pool, ckpts):
    before = {h["engine"]: h["pid"] for h in pool.health()}
    state = hf_state(ckpts[0])  # the first weights again, as version 2
    ckpts[2].write_text("load:hang")  # the first engine to load a bucket never returns
    start = time.monotonic()
    pool.sync(make_buckets(state.items(), int(0.05 * MIB)), version=2,
              metas=[TensorMeta.of(name, tensor) for name, tensor in state.items()])  # fmt: skip
    assert not ckpts[2].exists() and time.monotonic() - start < 120
    health = pool.health()
    assert all(h["ok"] and h["weight_version"] == pool.weight_version == 2 for h in health), health
    assert sum(h["pid"] != before[h["engine"]] for h in health) == 1
    assert _ids(pool.generate(PROMPTS, PARAMS)) == _ids(HFEngine(ckpts[0]).generate(PROMPTS, PARAMS))


def test_request_failing_twice_names_engine_and_request(ray_cluster, ckpts):
    config = RolloutConfig(engine="tests.helpers.rollout_engines:AlwaysCrashEngine", pool=PoolConfig(max_restarts=1))
    broken = RolloutPool(config, str(ckpts[0]), name_prefix="broken")
    try:
        with pytest.raises(RolloutEngineError, match=r"broken-0 failed request 0/1 \(prompts 0\.\.1 of 2\) again"):
            broken.generate(PROMPTS[:2], PARAMS)
    finally:
        broken.shutdown()


def test_bad_model_path_fails_at_start_naming_the_engine(ray_cluster, tmp_path):
    with pytest.raises(RolloutEngineError, match="rollout-0 failed to start"):
        RolloutPool(RolloutConfig(pool=PoolConfig(max_restarts=0)), str(tmp_path / "missing"))


def test_an_engine_slower_to_load_than_the_timeout_fails_naming_the_setting(ray_cluster, ckpts):
    config = RolloutConfig(engine="tests.helpers.rollout_engines:SlowStartEngine", engine_args={"start_delay_s": 60},
                           pool=PoolConfig(max_restarts=0, restart_timeout_s=1))  # fmt: skip
    with pytest.raises(RolloutEngineError, match=r"rollout-0 failed to start: not up within rollout.pool.restart_timeout_s=1$"):
        RolloutPool(config, str(ckpts[0]))


def test_engine_out_of_restarts_is_given_up_and_the_others_serve(ray_cluster, ckpts):
    # max_restarts=0: the killed engine never comes back. The pool knows Ray has no restart
    # left for it, so it is declared dead (not waited for until restart_timeout_s), and
    # the other engine serves every request.
    config = RolloutConfig(num_engines=2, pool=PoolConfig(max_restarts=0, restart_timeout_s=600))
    small = RolloutPool(config, str(ckpts[0]), name_prefix="once", placement=GroupPlacement.uniform(2, num_cpus=1))
    try:
        small.restart([1])
        assert small.live_engines == [0]
        dead = small.health()[1]
        assert not dead["ok"] and "once-1 is dead and will not restart" in dead["error"]
        results = small.generate(PROMPTS, PARAMS)
        assert {c.engine for g in results for c in g} == {"once-0"}
        with pytest.raises(RolloutEngineError, match="every rollout engine is dead"):
            small.restart([0])
    finally:
        small.shutdown()


def _kill_behind_the_pools_back(pool, engine, *, restarts):
    """Kill ``engine`` without the pool seeing it; ``restarts``: Ray has a restart left,
    so wait for the next process to answer, else until the engine reads as dead."""
    name, actor = pool.engine_names[engine], pool.actors[engine]
    old_pid = ray.get(actor.health.remote(), timeout=60)["pid"]
    ray.kill(actor, no_restart=False)
    if restarts:
        wait_until_back(actor, name, timeout_s=120, replaces_pid=old_pid, may_restart=True)
    else:
        with pytest.raises(RolloutEngineError, match="will not restart"):
            wait_until_back(actor, name, timeout_s=120, replaces_pid=old_pid, may_restart=False)


@pytest.mark.parametrize("missed_deaths", [1, 2])
def test_deaths_the_pool_missed_do_not_keep_it_waiting(ray_cluster, ckpts, missed_deaths, monkeypatch):
    # max_restarts=1: the engine dies behind the pool's back (as one dying mid-sync does
    # before a repair), then the pool restarts it. One missed death: the pool counts it
    # from the new process's pid, so its kill leaves Ray no restart and the engine is given
    # up at once. Two: Ray has given the actor up before the pool asks; the pool, counting
    # a restart left, takes calls that keep failing as "died" for DIED_FOR_GOOD_AFTER_S as
    # out of restarts. Either way not waited for until restart_timeout_s (600 s here).
    config = RolloutConfig(num_engines=2, pool=PoolConfig(max_restarts=1, restart_timeout_s=600))
    # Here every "died" is for good: 10 s of them is as conclusive as the default's 30.
    monkeypatch.setattr(recovery, "DIED_FOR_GOOD_AFTER_S", 10.0)
    name = f"missed{missed_deaths}"
    small = RolloutPool(config, str(ckpts[0]), name_prefix=name, placement=GroupPlacement.uniform(2, num_cpus=1))
    try:
        small.health()
        for death in range(1, missed_deaths + 1):
            _kill_behind_the_pools_back(small, 1, restarts=death <= config.pool.max_restarts)
        start = time.monotonic()
        small.restart([1])
        assert time.monotonic() - start < recovery.DIED_FOR_GOOD_AFTER_S + 60
        assert small.live_engines == [0]
        assert f"{name}-1 is dead and will not restart" in small.health()[1]["error"]
        assert small.generate(PROMPTS[:2], PARAMS)
    finally:
        small.shutdown()
