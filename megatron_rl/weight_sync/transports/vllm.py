"""The project's side of vLLM's weight-transfer API (imported only where vLLM is installed).

vLLM (>= 0.32) moves trainer weights into running engines through a weight-transfer
engine chosen by ``WeightTransferConfig(backend=...)``: on every vLLM worker,
``init_weight_transfer_engine`` (once) and ``start_weight_update`` ->
``update_weights`` -> ``finish_weight_update`` (per version, with layerwise reload:
each layer is rebuilt in place once all of its checkpoint-format tensors arrived, so
the CPU backend's repacked linear weights and the GPU's FP8 kernels stay right).

- ``nccl`` (GPUs on other devices) and ``ipc`` (colocated GPUs) are vLLM's own; the
  actor drives them with vLLM's trainer engines over :class:`VLLMSource`, the actor's
  HF-named tensor stream (:func:`open_sender`).
- ``megatron_rl_gloo`` is registered here (:func:`register`, run in every vLLM process
  through the ``vllm.general_plugins`` entry point): the ``gloo`` backend of
  :mod:`~megatron_rl.weight_sync.transports.gloo` as a vLLM worker-side engine. It carries host
  tensors, so it runs on CPU machines (CI exercises the GPU path's control flow with it)
  and is how a vLLM engine takes host tensors from its own process.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.base import WeightSource as _VLLMWeightSource

from megatron_rl.weight_sync.meta import dtype_of
from megatron_rl.weight_sync.transports.gloo import GlooInitInfo, GlooReceiver, WeightSource

__all__ = ["GLOO_BACKEND", "GlooWeightTransferEngine", "VLLMSource", "open_sender", "register"]

GLOO_BACKEND = "megatron_rl_gloo"
"""The name the gloo backend is registered under in vLLM's engine factory."""


@dataclass(kw_only=True)
class _GlooInitInfo(GlooInitInfo, WeightTransferInitInfo):
    """:class:`~megatron_rl.weight_sync.transports.gloo.GlooInitInfo` (its fields), as vLLM parses it."""


@dataclass
class _GlooUpdateInfo(WeightTransferUpdateInfo):
    """One version's stream: vLLM's NCCL backend's fields."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]


class GlooWeightTransferEngine(WeightTransferEngine[_GlooInitInfo, _GlooUpdateInfo]):
    """vLLM worker side of the ``gloo`` backend: receive chunks, load them layer by layer."""

    init_info_cls = _GlooInitInfo
    update_info_cls = _GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.receiver: GlooReceiver | None = None

    def init_transfer_engine(self, init_info: _GlooInitInfo) -> None:
        if self.receiver is not None:
            self.receiver.shutdown()
        config = self.parallel_config
        worker_rank = config.data_parallel_index * config.world_size + config.rank
        self.receiver = GlooReceiver(init_info, worker_rank=worker_rank)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        if self.device.type == "cpu":
            _refresh_cpu_gemms(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which has no device to
        # wait for on a CPU worker; the loads here are synchronous host->device copies.
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def receive_weights(self, update_info: _GlooUpdateInfo) -> None:
        if self.receiver is None:
            raise RuntimeError(f"{GLOO_BACKEND}: init_weight_transfer_engine() was not called")
        self.receiver.receive(asdict(update_info), load=self.load)

    def load(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Load tensors into the open update: what arrives over the group, and host tensors
        handed over in this process (a worker in the engine's own process)."""
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        with disable_mtp_completeness_check():
            self.model.load_weights(named_tensors)

    def shutdown(self) -> None:
        if self.receiver is not None:
            self.receiver.shutdown()
            self.receiver = None


def _refresh_cpu_gemms(model: torch.nn.Module) -> None:
    """Re-pack the CPU GEMM of every layer that keeps its weight (embedding, lm_head).

    On CPU, vLLM runs each linear through a kernel prepacked from the weight when the
    layer is processed. A tied ``lm_head`` shares the embedding's weight but receives no
    tensor of its own in a checkpoint-format update, so layerwise reload never
    reprocesses it: its prepacked copy would keep the previous embedding (measured: an
    engine over a tied Qwen2 then disagrees with the new weights by up to 0.9 in
    log-prob). Layers that dropped their weight after packing (``numel() == 0``) were
    reprocessed by the reload and are skipped.
    """
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    for module in model.modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "cpu_linear") and isinstance(weight, torch.Tensor) and weight.ndim == 2 and weight.numel():
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)


def register() -> None:
    """Register the ``megatron_rl_gloo`` backend with vLLM (idempotent; the
    ``vllm.general_plugins`` entry point runs it in every vLLM process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(GLOO_BACKEND, GlooWeightTransferEngine)
    except ValueError:  # already registered in this process
        pass


class VLLMSource(_VLLMWeightSource):
    """A project :class:`~megatron_rl.weight_sync.transports.gloo.WeightSource` as vLLM's
    ``WeightSource`` (torch dtypes in the metadata), for vLLM's trainer engines."""

    def __init__(self, source: WeightSource):
        self.source = source

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(m.name, dtype_of(m.dtype), tuple(m.shape)) for m in self.source.metadata()]

    def __iter__(self):
        return iter(self.source)


def open_sender(backend: str, *, client: Any, source: WeightSource, rank: int, **init: Any) -> Any:
    """vLLM's trainer engine of ``backend`` (``nccl`` or ``ipc``) over ``source``; ``init``
    holds the backend's trainer init fields (``master_address``, ``master_port``,
    ``world_size`` for ``nccl``; ``packed``, ``packed_buffer_size_bytes`` for both). Its
    ``send_weights()`` runs one version."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    if backend == "nccl":
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo as info_cls
    elif backend == "ipc":
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo as info_cls
    else:
        raise ValueError(f"open_sender: backend {backend!r} is not one of vLLM's (nccl, ipc)")
    return WeightTransferTrainerFactory.trainer_init(info_cls(rank=rank, **init), client=client, source=VLLMSource(source))
