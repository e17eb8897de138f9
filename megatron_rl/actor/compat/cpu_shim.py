"""Run megatron-core (0.16.1-0.19) on a CPU-only torch build (gloo backend).

This is the only module in megatron_rl that patches anything. megatron-core assumes
CUDA in a handful of places even when every tensor lives on the CPU; on a CPU build
of torch those calls raise ``AssertionError: Torch not compiled with CUDA enabled``.
No configuration flag avoids them (measured: a forward with every fusion off and
``use_cpu_initialization=True`` still fails in ``GlobalMemoryBuffer``), so the shim
replaces exactly these entry points, and nothing in Megatron's model code:

``apply()`` (process-wide, idempotent, a no-op when CUDA is available):
  * ``torch.cuda.current_device()`` returns ``"cpu"``: buffers in tensor_parallel,
    rotary embeddings, p2p communication, DDP buffers and dist-checkpointing are
    created with ``device=torch.cuda.current_device()``.
  * ``torch.cuda.synchronize()`` does nothing (p2p and checkpoint writers call it).
  * ``torch.cuda.get_rng_state`` / ``torch.cuda.manual_seed`` use the CPU generator,
    and megatron's ``tensor_parallel.random._get_cuda_rng_state`` /
    ``_set_cuda_rng_state`` read and write the CPU generator. On a CPU build the
    original setter queues the change through ``torch.cuda._lazy_call`` and never runs
    it, so dropout forks would silently share one stream.
  * ``torch.cuda.Event`` becomes a wall-clock stand-in (timing in the inference
    controller); the original raises when instantiated.
  * ``torch.cuda.Stream``, ``torch.cuda.current_stream`` and ``torch.cuda.stream`` become
    one stand-in stream that has nothing to wait for (a CPU runs one stream): the
    mixture-of-experts all-to-all token dispatcher creates a side stream when it is built
    and copies its split sizes to the host on it; megatron-core 0.19's DDP gradient sync
    asks for the current stream on every step.

``cuda_to_cpu()`` (a context manager, scoped): a ``TorchFunctionMode`` that rewrites
``device="cuda"`` in factory calls, makes ``Tensor.cuda()`` / ``Tensor.to("cuda")``
stay on the CPU, and makes ``Tensor.type()`` report ``torch.cuda.*`` names, because
the optimizer and pipeline schedules use ``device="cuda"`` literals and dispatch on
``param.type() == "torch.cuda.FloatTensor"``. Needed around model construction with
pipeline parallelism and tied embeddings, around pipeline schedules, the optimizer and
inference.

``transformer_config_overrides()``: the ``TransformerConfig`` flags a CPU run needs
(fused kernels off, CPU initialization). Keep ``pipeline_dtype`` equal to the
parameter dtype as well: with bf16 parameters and ``pipeline_dtype=float32`` the CPU
layer norm raises ``mixed dtype (CPU)``.

Call ``apply()`` after ``torch.distributed.init_process_group("gloo")`` and before
building models.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["apply", "is_applied", "cuda_to_cpu", "CudaToCpuMode", "suspended", "transformer_config_overrides"]

_applied = False


def is_applied() -> bool:
    """Whether :func:`apply` has patched this process."""
    return _applied


class _WallClockEvent:
    """Stand-in for ``torch.cuda.Event``: records ``time.perf_counter()``.

    Only the timing API megatron's inference controller uses is provided;
    ``elapsed_time`` returns milliseconds like the CUDA event does.
    """

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self._t: float | None = None

    def record(self, stream: Any = None) -> None:
        self._t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "_WallClockEvent") -> float:
        return (end._t - self._t) * 1e3


def apply() -> bool:
    """Patch the torch.cuda device/RNG entry points megatron-core calls (see module doc).

    Returns True when this call patched the process, False when nothing was done:
    CUDA is available (the shim must never touch a GPU process) or the process was
    patched already.
    """
    global _applied
    if torch.cuda.is_available() or _applied:
        return False

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.random.get_rng_state = torch.cuda.get_rng_state
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)
    torch.cuda.Event = _WallClockEvent
    torch.cuda.Stream = _NullStream
    torch.cuda.current_stream = _null_stream
    torch.cuda.stream = _null_stream_context

    # Imported here: megatron-core is heavy and this module must stay cheap to import.
    from megatron.core.tensor_parallel import random as megatron_random

    def get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        state = torch.get_rng_state()
        return state.clone() if clone else state

    def set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    megatron_random._get_cuda_rng_state = get_rng_state
    megatron_random._set_cuda_rng_state = set_rng_state
    _applied = True
    return True


class _NullStream:
    """Stand-in for ``torch.cuda.Stream`` on a CPU-only torch: every operation has completed
    when it returns, so there is nothing to wait for or record. A class (annotations such
    as ``torch.cuda.Stream | None``, evaluated when transformers imports, need one) whose
    every construction returns the one instance, :data:`NULL_STREAM`."""

    _instance: _NullStream | None = None

    def __new__(cls, *args: Any, **kwargs: Any) -> _NullStream:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> Any:
        """``event`` (a new one when None), recorded: the all-to-all dispatcher waits on it."""
        event = _WallClockEvent() if event is None else event
        event.record()
        return event

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "<megatron_rl CPU stand-in for torch.cuda.Stream>"


NULL_STREAM = _NullStream()
"""The CPU's one stream: what ``torch.cuda.Stream(...)`` and ``current_stream()`` return under the shim."""


def _null_stream(*args: Any, **kwargs: Any) -> _NullStream:
    return NULL_STREAM


def _null_stream_context(stream: Any = None) -> contextlib.AbstractContextManager:
    """``torch.cuda.stream(s)``: nothing to switch to."""
    return contextlib.nullcontext()


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


_REWRITTEN = frozenset({"type", "cuda", "to"})
"""Tensor methods :class:`CudaToCpuMode` rewrites whatever their keyword arguments."""


class CudaToCpuMode(TorchFunctionMode):
    """Redirect CUDA placements to the CPU for the torch calls made inside the mode.

    * ``device="cuda"`` (or ``torch.device("cuda")``) keyword -> ``"cpu"``;
    * ``tensor.cuda()`` -> the tensor itself; ``tensor.to("cuda", ...)`` -> CPU;
    * ``tensor.type()`` -> ``"torch.cuda.FloatTensor"``-style names, so that
      megatron's optimizer dispatch on the CUDA type name takes the normal branch.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        # The common case first (every op of a forward runs through here): nothing to rewrite.
        if name not in _REWRITTEN and not (kwargs and "device" in kwargs):
            return func(*args, **(kwargs or {}))
        kwargs = dict(kwargs or {})
        if name == "type" and len(args) == 1 and not kwargs:
            type_name = func(*args)
            if type_name.startswith("torch.") and not type_name.startswith("torch.cuda."):
                return "torch.cuda." + type_name[len("torch.") :]
            return type_name
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if name == "cuda":
            return args[0]
        if name == "to" and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def cuda_to_cpu() -> contextlib.AbstractContextManager:
    """Context manager: :class:`CudaToCpuMode` on a CPU-only torch, a no-op with CUDA
    (``with cuda_to_cpu() as mode``: the mode, or ``None``)."""
    if torch.cuda.is_available():
        return contextlib.nullcontext()
    return CudaToCpuMode()


@contextlib.contextmanager
def suspended(mode: CudaToCpuMode | None) -> Iterator[None]:
    """Step out of ``mode`` for the body and back in after it; ``None`` does nothing.

    For the project's own callbacks inside a megatron schedule (the model's forward and
    the loss), which create nothing on ``"cuda"``: there the mode only costs time, since
    every torch call would go through ``__torch_function__`` in Python (about 1,900 calls,
    3-5 ms of CPU time of a 0.15 s train step of the benchmark's 0.8M-parameter model). ``mode``
    must be the innermost torch-function mode, as it is when entered right around the
    schedule (the mode stack is popped and pushed; megatron enters no modes of its own).
    """
    if mode is None:
        yield
        return
    mode.__exit__(None, None, None)
    try:
        yield
    finally:
        mode.__enter__()


def transformer_config_overrides() -> dict[str, Any]:
    """``TransformerConfig`` keyword arguments a CPU run needs; ``{}`` when CUDA is available.

    The fused kernels (bias-activation, masked softmax, bias-dropout, RoPE, gradient
    accumulation) exist only as CUDA kernels; CPU initialization keeps parameter
    construction off the (absent) GPU.
    """
    if torch.cuda.is_available():
        return {}
    return {
        "use_cpu_initialization": True,
        "gradient_accumulation_fusion": False,
        "bias_activation_fusion": False,
        "masked_softmax_fusion": False,
        "bias_dropout_fusion": False,
        "apply_rope_fusion": False,
        "persist_layer_norm": False,
    }
