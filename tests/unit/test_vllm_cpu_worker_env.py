"""The environment vLLM's CPU workers start with: unpinned, each with its share of the
engine's threads (the real engine's worker affinity: tests/vllm/test_vllm_engine.py; a
two-worker engine runs with it in tests/vllm/test_vllm_tensor_parallel.py)."""

import pytest

from megatron_rl.rollout.engines.vllm import cpu_worker_env


@pytest.mark.parametrize(("workers", "share", "threads"), [(1, 2, "2"), (2, 2, "1"), (2, 1, "1"), (4, 8, "2"), (1, 1, "1")])
def test_each_worker_runs_its_share_of_the_engines_threads_unpinned(workers, share, threads):
    assert cpu_worker_env(workers=workers, cores_per_engine=share) == {
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": threads,
    }
