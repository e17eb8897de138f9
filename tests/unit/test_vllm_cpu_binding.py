"""``VLLM_CPU_OMP_THREADS_BIND`` of a tensor-parallel vLLM engine on CPU: each worker gets
its share of the engine's cores (the real engine is tested in tests/vllm/test_vllm_tensor_parallel.py)."""

import pytest

from megatron_rl.rollout.engines.vllm import cpu_binding


@pytest.mark.parametrize(
    ("cores", "workers", "share", "want"),
    [([0, 1], 2, 1, "0|1"), ([0, 1], 2, 2, "0|1"), ([0, 1, 2, 3], 2, 4, "0,1|2,3"), ([5], 2, 1, "5|5"),
     ([0, 1, 2, 3, 4, 5, 6, 7], 4, 8, "0,1|2,3|4,5|6,7")],
)  # fmt: skip
def test_cpu_binding_splits_the_engine_share(cores, workers, share, want):
    assert cpu_binding(cores, workers=workers, cores_per_engine=share) == want
