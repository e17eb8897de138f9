"""FP8 rollout weights (``rollout.weight_dtype: fp8``): block-wise e4m3 on the wire.

The format is the one vLLM's block-FP8 loader reads (``quantization: fp8`` with
``weight_block_size: [128, 128]``): each linear-layer weight ``W [R, C]`` of the
attention and MLP projections travels as

- ``<name>``: ``float8_e4m3fn [R, C]``, ``W / s`` rounded to e4m3, and
- ``<name>_scale_inv``: ``float32 [ceil(R/128), ceil(C/128)]``, the scale ``s`` of each
  128 x 128 block, ``amax(|W_block|) / 448`` (448: e4m3's largest finite value),

so ``W ~= q * s`` block by block. Embeddings, norms, biases and the LM head stay in the
engines' dtype (vLLM keeps them unquantized too). The quantization itself is
nvidia-modelopt's ``FP8QTensor`` (pure Python; it installs on CPU machines too), with the
scales computed here so that an all-zero block gets a finite scale instead of 0/0.

Error bound: e4m3 keeps 3 mantissa bits, so a value rounded in the normal range is off by
at most 2^-4 of itself; values below e4m3's smallest normal (2^-6 of the block's scale)
are off by at most half a subnormal step, 2^-10 of the scale. Per tensor,
``max |W - q s| <= 2^-4 max |W|``.

The sender wraps its weight source in :class:`Fp8Source`; receivers that load plain
tensors (the built-in engine) undo it with :class:`Dequantizer`, which pairs each weight
with its scales whichever chunk they arrive in.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence

import torch

from megatron_rl.weight_sync.meta import TensorMeta, WeightUpdateError

__all__ = [
    "BLOCK",
    "Dequantizer",
    "Fp8Source",
    "dequantize",
    "is_quantized",
    "quantize",
    "scale_name",
    "wire_metas",
]

BLOCK = 128
"""Block edge of the scales, both dimensions (vLLM's ``weight_block_size``)."""

E4M3_MAX = 448.0
"""The largest finite float8_e4m3fn value."""

FP8 = "float8_e4m3fn"

_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The linear layers sent in FP8 (HF Qwen2/Llama names), as vLLM's FP8 linear method covers."""

_SCALE_SUFFIX = "_scale_inv"


def is_quantized(name: str, shape: Sequence[int]) -> bool:
    """Whether tensor ``name`` of ``shape`` travels as FP8 (a 2-D projection weight)."""
    parts = name.split(".")
    return len(shape) == 2 and parts[-1] == "weight" and len(parts) >= 2 and parts[-2] in _PROJECTIONS


def scale_name(name: str) -> str:
    """The name of the block scales of weight ``name`` (``...weight_scale_inv``)."""
    return name + _SCALE_SUFFIX


def _block_sizes() -> dict[int, int]:
    return {-1: BLOCK, -2: BLOCK}


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``W [R, C]`` -> ``(q float8_e4m3fn [R, C], scale_inv float32 [ceil(R/128), ceil(C/128)])``."""
    from modelopt.torch.quantization.qtensor import FP8QTensor

    w = weight.detach().float()
    rows, cols = w.shape
    padded = torch.nn.functional.pad(w, (0, -cols % BLOCK, 0, -rows % BLOCK))
    amax = padded.abs().reshape(padded.shape[0] // BLOCK, BLOCK, padded.shape[1] // BLOCK, BLOCK).amax(dim=(1, 3))
    # an all-zero block: any positive scale represents it exactly (0 / s = 0)
    scales = torch.where(amax > 0, amax, torch.ones_like(amax)) / E4M3_MAX
    qtensor, scales = FP8QTensor.quantize(w, scales=scales, block_sizes=_block_sizes())
    return qtensor._quantized_data.contiguous(), scales.float().contiguous()


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of :func:`quantize`: ``q * s`` block by block, as ``dtype`` (``[R, C]``)."""
    from modelopt.torch.quantization.qtensor import FP8QTensor

    want = (math.ceil(q.shape[0] / BLOCK), math.ceil(q.shape[1] / BLOCK))
    if tuple(scale_inv.shape) != want:
        raise WeightUpdateError(f"FP8 block scales of shape {tuple(scale_inv.shape)} for a weight {tuple(q.shape)}; "
                                f"expected {want}")  # fmt: skip
    qtensor = FP8QTensor(q.shape, dtype, q)
    return qtensor.dequantize(torch.float32, scale=scale_inv.float(), block_sizes=_block_sizes()).to(dtype)


def wire_metas(metas: Iterable[TensorMeta]) -> list[TensorMeta]:
    """What an update carries in FP8: each quantized weight becomes its e4m3 tensor and its scales."""
    out = []
    for meta in metas:
        if is_quantized(meta.name, meta.shape):
            rows, cols = meta.shape
            out.append(TensorMeta(meta.name, FP8, tuple(meta.shape)))
            out.append(TensorMeta(scale_name(meta.name), "float32", (math.ceil(rows / BLOCK), math.ceil(cols / BLOCK))))
        else:
            out.append(meta)
    return out


class Fp8Source:
    """A weight source (``metadata()`` + iteration of ``(name, tensor)``) sending FP8.

    Wraps another source whose tensors are in the engines' dtype; quantizes each
    projection weight as it streams past (one tensor at a time: no extra copy of the model).
    """

    def __init__(self, source):
        self.source = source

    def metadata(self) -> list[TensorMeta]:
        return wire_metas(self.source.metadata())

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.source:
            if is_quantized(name, tensor.shape):
                q, scale_inv = quantize(tensor)
                yield name, q
                yield scale_name(name), scale_inv
            else:
                yield name, tensor


class Dequantizer:
    """Receiver side: turns FP8 wire tensors back into plain ``dtype`` tensors.

    ``feed`` takes any run of wire tensors and returns the plain tensors that are complete
    (a weight whose scales have not arrived yet waits); ``finish`` raises if one is still
    waiting at the end of an update.
    """

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self._pending: dict[str, torch.Tensor] = {}

    def feed(self, named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        out = []
        for name, tensor in named:
            if name.endswith(_SCALE_SUFFIX):
                weight = name[: -len(_SCALE_SUFFIX)]
                other = self._pending.pop(weight, None)
                if other is None:
                    self._pending[name] = tensor.clone()  # the views die with their chunk buffer
                else:
                    out.append((weight, dequantize(other, tensor, self.dtype)))
            elif tensor.dtype == torch.float8_e4m3fn:
                scales = self._pending.pop(scale_name(name), None)
                if scales is None:
                    self._pending[name] = tensor.clone()
                else:
                    out.append((name, dequantize(tensor, scales, self.dtype)))
            else:
                out.append((name, tensor))
        return out

    def finish(self) -> None:
        if self._pending:
            names = sorted(self._pending)
            self._pending.clear()
            raise WeightUpdateError(
                f"FP8 update ended with {len(names)} weight(s) lacking their pair, e.g. {names[0]!r}"
            )
