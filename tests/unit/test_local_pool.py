"""``rollout.engine_process: driver``: one engine in the driver's process (LocalRolloutPool).

Checked against what it stands in for: the same samples as an engine generating the
whole call itself (the Ray pool's own test holds its samples to the same reference), a
weight sync that leaves the engine equal to a fresh one on the new weights, refusals
and engine errors that name the engine and leave the weights alone, and a config error
for every setting an engine in the driver cannot honour. The whole run with it, against
the Ray engine: tests/e2e/test_engine_in_driver.py.
"""

import os

import pytest

from megatron_rl.config.lib import ConfigError
from megatron_rl.config.rollout import PoolConfig, RolloutConfig
from megatron_rl.rollout import RolloutEngineError, SamplingParams
from megatron_rl.rollout.engines.hf import HFEngine
from megatron_rl.rollout.pool.local import LocalRolloutPool
from megatron_rl.weight_sync.buckets import MIB, make_buckets
from megatron_rl.weight_sync.meta import TensorMeta
from tests.helpers.rollout_models import hf_state, save_qwen2

PROMPTS = [[1, 2, 3], [5] * 9, [7, 8], list(range(20, 37)), [3], [9, 9, 1, 4]]
PARAMS = SamplingParams(n=3, temperature=0.7, max_new_tokens=10, seed=17)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("local_pool")
    return save_qwen2(root / "a", seed=0), save_qwen2(root / "b", seed=7)


def _pool(path, **rollout):
    return LocalRolloutPool(RolloutConfig(engine_process="driver", **rollout), str(path))


def _ids(results):
    return [[c.token_ids for c in group] for group in results]


def test_generate_matches_one_engine_serving_the_whole_call(ckpts):
    pool = _pool(ckpts[0])
    results = pool.generate(PROMPTS, PARAMS)
    assert _ids(results) == _ids(HFEngine(ckpts[0]).generate(PROMPTS, PARAMS))
    assert all(c.engine == "rollout-0" and c.weight_version == 0 for g in results for c in g)
    assert [len(g) for g in results] == [PARAMS.n] * len(PROMPTS)
    assert pool.last_stats["rollout/num_requests"] == 1
    assert pool.health()[0]["pid"] == os.getpid()  # in this process
    # Seeds follow the prompt's position in the call, not the request split.
    split = _pool(ckpts[0], pool=PoolConfig(max_prompts_per_request=1))
    assert _ids(split.generate(PROMPTS, PARAMS)) == _ids(results)
    assert split.last_stats["rollout/num_requests"] == len(PROMPTS)
    assert pool.generate([], PARAMS) == []


def test_weight_sync_equals_a_fresh_engine(ckpts):
    pool = _pool(ckpts[0])
    state = hf_state(ckpts[1])
    metas = [TensorMeta.of(name, tensor) for name, tensor in state.items()]
    stats = pool.sync(make_buckets(state.items(), int(0.05 * MIB)), version=1, metas=metas)
    assert stats["weight_sync/bytes"] == sum(t.numel() * t.element_size() for t in state.values())
    assert stats["weight_sync/num_buckets"] > 3 and stats["weight_sync/num_tensors"] == len(state)
    assert stats["weight_sync/num_engines"] == 1 and stats["weight_sync/version"] == 1
    assert pool.weight_version == 1 and pool.health()[0]["weight_version"] == 1
    results = pool.generate(PROMPTS, PARAMS)
    assert _ids(results) == _ids(HFEngine(ckpts[1]).generate(PROMPTS, PARAMS))
    assert all(c.weight_version == 1 for g in results for c in g)


def test_refused_update_names_the_engine_and_keeps_the_weights(ckpts):
    pool = _pool(ckpts[0])
    before = _ids(pool.generate(PROMPTS, PARAMS))
    state = hf_state(ckpts[1])
    name, tensor = next(iter(state.items()))
    wrong = [TensorMeta.of(name, tensor[:1])]  # a shape the engine's model does not have
    with pytest.raises(RolloutEngineError, match=r"rollout-0.*version 3"):
        pool.sync(make_buckets([(name, tensor[:1])], MIB), version=3, metas=wrong)
    assert pool.weight_version == 0
    assert _ids(pool.generate(PROMPTS, PARAMS)) == before


def test_engine_error_names_the_engine_and_the_request(ckpts):
    pool = _pool(ckpts[0], engine="tests.helpers.rollout_engines:RaisesOnGenerateEngine",
                 engine_args={"bad_token": 7}, pool=PoolConfig(max_prompts_per_request=2))  # fmt: skip
    with pytest.raises(RolloutEngineError, match=r"rollout-0 raised on .*prompts 2\.\.3.*refusing prompts"):
        pool.generate(PROMPTS, PARAMS)
    with pytest.raises(RolloutEngineError, match="cannot be restarted"):
        pool.restart([0])


def test_bad_model_path_fails_at_start_naming_the_engine(tmp_path):
    with pytest.raises(RolloutEngineError, match="rollout-0 failed to start"):
        _pool(tmp_path / "missing")


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"num_engines": 2}, "num_engines"),
        ({"tensor_parallel_size": 2}, "tensor_parallel_size"),
        ({"weight_transport": "collective"}, "weight_transport"),
        ({"engine": "vllm"}, "engine"),
        ({"pool": PoolConfig(max_restarts=5)}, "pool.max_restarts"),
        ({"pool": PoolConfig(request_timeout_s=30.0)}, "pool.request_timeout_s"),
        ({"pool": PoolConfig(keep_weights_for_restart=False)}, "pool.keep_weights_for_restart"),
    ],
)
def test_settings_an_engine_in_the_driver_cannot_honour_are_errors(settings, field):
    with pytest.raises(ConfigError) as info:
        RolloutConfig(engine_process="driver", **settings)
    assert info.value.path == field
    RolloutConfig(engine_process="ray_actor", **settings)  # fine for Ray engines
