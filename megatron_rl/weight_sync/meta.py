"""What a weight update carries, and the checks an engine runs before anything moves.

A weight update is the whole model as HF-named full tensors (``TensorMeta``: name,
dtype, shape) in the order the actor produces them. Before any byte moves, every
engine checks the update's metadata against the tensors it expects
(:func:`check_update`); an unknown name, a wrong shape or dtype, or a missing tensor
raises :class:`WeightUpdateError` naming the engine, the tensor and the version, and the
engine keeps its previous weights. Transports then cut the stream into chunks of at
most ``chunk_bytes`` (:func:`plan_chunks`): sender and receivers derive the same plan
from the same metadata, so nothing but the metadata crosses the control plane.

The two contracts every sender is written against live here too: a
:class:`WeightSource` (what is sent: the actor's ``actor.weights.HFWeightSource``, or its
FP8 form) and a :class:`WeightSyncClient` (the engines' control plane a sender drives:
``weight_sync.client.EngineGroupClient``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

__all__ = [
    "TensorMeta",
    "UnknownWeightError",
    "WeightSource",
    "WeightSyncClient",
    "WeightUpdateError",
    "check_update",
    "dtype_of",
    "pack_chunk",
    "plan_chunks",
    "unpack_chunk",
]


class WeightUpdateError(ValueError):
    """A weight update does not fit the engine's model (raised before anything is loaded)."""


class UnknownWeightError(WeightUpdateError, KeyError):
    """A weight update names a tensor the engine's model does not have."""

    __str__ = Exception.__str__  # KeyError would quote the whole message


def dtype_of(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16`` (the dtype names the wire carries)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise WeightUpdateError(f"unknown dtype name {name!r}")
    return dtype


@dataclass(frozen=True)
class TensorMeta:
    """One tensor of a weight update: HF name, dtype name (``"float32"``) and full shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorMeta:
        return cls(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))

    @property
    def num_bytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * dtype_of(self.dtype).itemsize


def check_update(
    expected: Mapping[str, TensorMeta],
    metas: Sequence[TensorMeta],
    *,
    engine: str,
    version: int,
    require_all: bool,
) -> None:
    """Raise :class:`WeightUpdateError` unless ``metas`` fits the model described by ``expected``.

    Args:
        expected: ``{HF name: TensorMeta}`` the engine's model holds, in the wire dtype.
        metas: the update's tensors.
        engine, version: named in the error.
        require_all: every expected tensor must be in the update (engines that rebuild
            a layer from all of its tensors at once, like vLLM's layerwise reload, need
            whole layers; a whole model is the simple rule).
    """
    seen: set[str] = set()
    for meta in metas:
        want = expected.get(meta.name)
        if want is None:
            raise UnknownWeightError(
                f"{engine}: weight update to version {version} has tensor {meta.name!r}, which the engine's "
                f"model does not have ({len(expected)} tensors, e.g. {next(iter(expected), '-')!r})"
            )
        if meta.name in seen:
            raise WeightUpdateError(f"{engine}: weight update to version {version} has {meta.name!r} twice")
        seen.add(meta.name)
        if tuple(meta.shape) != tuple(want.shape):
            raise WeightUpdateError(
                f"{engine}: weight update to version {version}: tensor {meta.name!r} has shape "
                f"{tuple(meta.shape)}; the engine's model has {tuple(want.shape)}"
            )
        if meta.dtype != want.dtype:
            raise WeightUpdateError(
                f"{engine}: weight update to version {version}: tensor {meta.name!r} is {meta.dtype}; "
                f"the engine loads {want.dtype}"
            )
    if require_all and len(seen) != len(expected):
        missing = [name for name in expected if name not in seen]
        raise WeightUpdateError(
            f"{engine}: weight update to version {version} lacks {len(missing)} of the model's tensors "
            f"(first {missing[0]!r}); a sync carries the whole model"
        )


def plan_chunks(metas: Sequence[TensorMeta], chunk_bytes: int) -> list[range]:
    """Consecutive index ranges of ``metas`` of at most ``chunk_bytes`` each (a larger
    tensor is a chunk of its own; tensors are never split)."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes: got {chunk_bytes}; must be >= 1")
    chunks: list[range] = []
    start, size = 0, 0
    for i, meta in enumerate(metas):
        nbytes = meta.num_bytes
        if i > start and size + nbytes > chunk_bytes:
            chunks.append(range(start, i))
            start, size = i, 0
        size += nbytes
    if start < len(metas):
        chunks.append(range(start, len(metas)))
    return chunks


def pack_chunk(tensors: Iterable[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """The tensors' bytes back to back in one flat ``uint8`` host tensor (``out`` if given)."""
    views = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    total = sum(v.numel() for v in views)
    buffer = out[:total] if out is not None and out.numel() >= total else torch.empty(total, dtype=torch.uint8)
    offset = 0
    for view in views:
        buffer[offset : offset + view.numel()].copy_(view)
        offset += view.numel()
    return buffer


def unpack_chunk(buffer: torch.Tensor, metas: Sequence[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` views into ``buffer`` (no copy), the inverse of :func:`pack_chunk`."""
    out, offset = [], 0
    for meta in metas:
        nbytes = meta.num_bytes
        out.append((meta.name, buffer[offset : offset + nbytes].view(dtype_of(meta.dtype)).reshape(meta.shape)))
        offset += nbytes
    if offset != buffer.numel():
        raise WeightUpdateError(f"chunk holds {buffer.numel()} bytes; its {len(metas)} tensors need {offset}")
    return out


class WeightSource(Protocol):
    """A re-iterable stream of HF-named full tensors (the shape of vLLM's ``WeightSource``).

    ``metadata()`` lists, without transferring anything, exactly what iteration yields, in
    the same order. Iteration may run collectives (gathers over TP/PP), so every rank that
    shares the model iterates it in lockstep; only the sender's tensors are sent.
    """

    def metadata(self) -> list[TensorMeta]: ...

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]: ...


class WeightSyncClient(Protocol):
    """The engines' weight-sync control plane as the sender drives it (the shape of vLLM's
    ``VLLMWeightSyncClient``)."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: dict[str, Any]) -> None: ...

    def finish_weight_update(self) -> None: ...
