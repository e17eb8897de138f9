"""The vLLM engine on a GPU: log-probs, in-place weight updates, sleep/wake, TP=2, the pool.

Skipped with the reason stated when vLLM is not installed (it is CUDA-only: CPU CI never
has it) or when no CUDA device is visible (tests/conftest.py). Nothing here is mocked:
these tests exist to run the real engine on a GPU machine.
"""

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (CUDA-only; pip install -e '.[gpu]')")

from megatron_rl.rollout import SamplingParams  # noqa: E402
from megatron_rl.rollout.vllm_engine import VLLMEngine  # noqa: E402
from tests.helpers.rollout_models import build_qwen2, hf_state, reference_logprobs, save_qwen2  # noqa: E402

PROMPTS = [[1, 2, 3], [5] * 9, [7, 8], list(range(20, 37))]
PARAMS = SamplingParams(n=3, temperature=0.7, max_new_tokens=12, seed=5)
# float32 weights and compute: the comparison against a float32 transformers forward then
# measures the engine's own arithmetic, not bf16 rounding.
ENGINE_ARGS = dict(dtype="float32", gpu_memory_utilization=0.2, enforce_eager=True, max_model_len=256)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_engine")
    # vLLM's kernels want head_dim 64 or more: 256 hidden / 4 heads.
    overrides = dict(hidden_size=256, intermediate_size=512)
    return save_qwen2(root / "a", seed=0, **overrides), save_qwen2(root / "b", seed=7, **overrides), overrides


@pytest.fixture(scope="module")
def engine(ckpts):
    eng = VLLMEngine(ckpts[0], **ENGINE_ARGS)
    yield eng
    eng.shutdown()


def _ids(results):
    return [[c.token_ids for c in group] for group in results]


def test_logprobs_match_a_transformers_forward(engine, ckpts):
    results = engine.generate(PROMPTS, PARAMS)
    model = build_qwen2(0, **ckpts[2])
    worst = 0.0
    for prompt, group in zip(PROMPTS, results):
        assert len(group) == PARAMS.n
        for c in group:
            ref = reference_logprobs(model, prompt, c.token_ids, PARAMS.temperature)
            worst = max(worst, (ref - torch.tensor(c.logprobs)).abs().max().item())
            assert c.finish_reason == "length" and len(c.token_ids) == PARAMS.max_new_tokens
    assert worst < 2e-3  # float32 GPU kernels vs float32 CPU reference


def test_same_seed_same_samples_and_stop_tokens(engine):
    first = engine.generate(PROMPTS, PARAMS)
    assert _ids(engine.generate(PROMPTS, PARAMS)) == _ids(first)
    stop = first[0][0].token_ids[0]
    stopped = engine.generate(PROMPTS, SamplingParams(n=3, temperature=0.7, max_new_tokens=12, seed=5,
                                                      stop_token_ids=[stop]))  # fmt: skip
    assert stopped[0][0].token_ids == [stop] and stopped[0][0].finish_reason == "stop"


def test_update_weights_in_place_equals_a_fresh_engine(ckpts):
    engine = VLLMEngine(ckpts[0], **ENGINE_ARGS)
    try:
        engine.generate(PROMPTS, PARAMS)  # fill the prefix cache with version-0 KV blocks
        engine.update_weights(hf_state(ckpts[1]).items(), version=1)
        updated = engine.generate(PROMPTS, PARAMS)
        assert all(c.weight_version == 1 for g in updated for c in g)
    finally:
        engine.shutdown()
    fresh_engine = VLLMEngine(ckpts[1], **ENGINE_ARGS)
    try:
        assert _ids(updated) == _ids(fresh_engine.generate(PROMPTS, PARAMS))
    finally:
        fresh_engine.shutdown()


def test_sleep_sync_wake(ckpts):
    engine = VLLMEngine(ckpts[0], **ENGINE_ARGS)
    try:
        before = engine.generate(PROMPTS, PARAMS)
        free_before = torch.cuda.mem_get_info()[0]
        engine.sleep()
        assert torch.cuda.mem_get_info()[0] > free_before  # memory was released
        engine.update_weights(hf_state(ckpts[0]).items(), version=2)  # colocated sync while asleep
        engine.wake()
        assert _ids(engine.generate(PROMPTS, PARAMS)) == _ids(before)
    finally:
        engine.shutdown()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism needs 2 CUDA devices")
def test_tensor_parallel_two(ckpts):
    engine = VLLMEngine(ckpts[0], tensor_parallel_size=2, **ENGINE_ARGS)
    try:
        engine.update_weights(hf_state(ckpts[1]).items(), version=1)
        results = engine.generate(PROMPTS, PARAMS)
        model = build_qwen2(7, **ckpts[2])
        for prompt, group in zip(PROMPTS, results):
            for c in group:
                ref = reference_logprobs(model, prompt, c.token_ids, PARAMS.temperature)
                assert (ref - torch.tensor(c.logprobs)).abs().max().item() < 2e-3
    finally:
        engine.shutdown()


def test_pool_of_vllm_engines(ckpts):
    ray = pytest.importorskip("ray")
    from megatron_rl.config import RolloutConfig
    from megatron_rl.placement import GroupPlacement
    from megatron_rl.rollout import RolloutPool
    from megatron_rl.weight_buckets import MIB, make_buckets

    ray.init(num_gpus=1, include_dashboard=False, log_to_driver=False)
    try:
        config = RolloutConfig(engine="vllm", engine_args=dict(ENGINE_ARGS))
        pool = RolloutPool(config, str(ckpts[0]), placement=GroupPlacement.uniform(1, num_gpus=1))
        stats = pool.sync(make_buckets(hf_state(ckpts[1]).items(), MIB), version=1)
        assert stats["weight_sync/num_buckets"] > 1
        results = pool.generate(PROMPTS, PARAMS)
        assert all(c.weight_version == 1 for g in results for c in g)
        pool.shutdown()
    finally:
        ray.shutdown()
