"""The weight-bucket format: HF-named full tensors grouped into buckets of raw bytes.

The actor produces buckets (``actor.weights.iter_hf_weights`` grouped here) and every
rollout engine consumes them (``WeightReceiver.load_bucket``); this module is the format
both sides share, so neither imports the other.

A bucket is a table of (name, dtype, shape) plus one raw-byte numpy array per tensor.
Numpy rather than torch because Ray serialises numpy buffers out-of-band (pickle
protocol 5): ``ray.put`` is the only copy a producer makes of a host tensor, and
``ray.get`` makes none (every engine maps the arrays zero-copy from the shared-memory
object store); a torch tensor would be pickled into the byte stream and copied again on
every engine. bf16, which numpy lacks, travels as bytes too.

Why buckets rather than one object per tensor: a few large object-store entries instead
of hundreds of small ones (a Qwen2-7B sync is ~30 buckets of 512 MiB instead of ~340
tensors), and the producer (the actor gathering TP/PP shards) runs one bucket ahead of
the engines. Tensors are not packed into one flat buffer per bucket: that extra copy
into freshly allocated memory costs more than the whole ``ray.put`` on a CPU machine.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from megatron_rl.weight_sync.meta import TensorMeta

__all__ = [
    "MIB",
    "WeightBucket",
    "bucket_named_tensors",
    "make_bucket",
    "make_buckets",
    "sync_stats",
    "unpack_bucket",
]

logger = logging.getLogger(__name__)

MIB = 1 << 20


@dataclass
class WeightBucket:
    """A group of HF-named tensors as raw byte arrays, ready for ``ray.put``.

    ``entries[i] = (name, dtype name, shape)`` describes ``arrays[i]``, a 1-D ``uint8``
    numpy view of the tensor's bytes (numpy, not torch: Ray serialises numpy buffers
    out-of-band, so ``ray.put`` copies each byte once into the object store and every
    ``ray.get`` maps it without a copy; bf16, which numpy lacks, travels as bytes too).
    """

    entries: list[tuple[str, str, tuple[int, ...]]]
    arrays: list[np.ndarray]

    @property
    def num_bytes(self) -> int:
        """Payload bytes."""
        return sum(a.nbytes for a in self.arrays)


def bucket_named_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group ``(name, tensor)`` pairs, in order, into lists of at most ``bucket_bytes`` bytes.

    A tensor larger than ``bucket_bytes`` forms a bucket of its own (tensors are never
    split: engines load whole tensors). Empty buckets are never yielded.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes: got {bucket_bytes}; must be >= 1")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def make_bucket(named_tensors: list[tuple[str, torch.Tensor]]) -> WeightBucket:
    """Byte views of the tensors (host tensors: no copy; device tensors: copied to host)."""
    entries, arrays = [], []
    for name, tensor in named_tensors:
        data = tensor.detach()
        if data.device.type != "cpu":
            data = data.cpu()
        # reshape(-1).view(uint8) reinterprets the bytes (bf16 included); contiguous() copies
        # only strided tensors.
        arrays.append(data.contiguous().reshape(-1).view(torch.uint8).numpy())
        entries.append((name, str(data.dtype).removeprefix("torch."), tuple(data.shape)))
    return WeightBucket(entries=entries, arrays=arrays)


def unpack_bucket(bucket: WeightBucket) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` views of the bucket's arrays (no copy; read-only when from Ray).

    The views are only valid while ``bucket`` is alive; engines copy them into their
    parameters right away.
    """
    out = []
    with warnings.catch_warnings():
        # Ray hands out object-store buffers read-only; torch warns about wrapping a
        # non-writable array. The views are only read (copied into parameters).
        warnings.simplefilter("ignore", UserWarning)
        for (name, dtype, shape), array in zip(bucket.entries, bucket.arrays):
            out.append((name, torch.from_numpy(array).view(getattr(torch, dtype)).reshape(shape)))
    return out


def make_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[WeightBucket]:
    """:func:`bucket_named_tensors` then :func:`make_bucket`: buckets ready for ``ray.put``."""
    for tensors in bucket_named_tensors(named_tensors, bucket_bytes):
        yield make_bucket(tensors)


def sync_stats(
    seconds: float, *, put_seconds: float, metas: list[TensorMeta], num_buckets: int, num_engines: int, version: int
) -> dict[str, float]:
    """The statistics of one bucket sync into a pool (``RolloutPool.sync``'s return); logs a line."""
    num_bytes = sum(m.num_bytes for m in metas)
    logger.info("weight sync v%d: %.3f GiB in %d buckets to %d engines in %.2fs", version, num_bytes / (1 << 30),
                num_buckets, num_engines, seconds)  # fmt: skip
    return {
        "weight_sync/seconds": seconds,
        "weight_sync/put_seconds": put_seconds,
        "weight_sync/bytes": float(num_bytes),
        "weight_sync/num_tensors": float(len(metas)),
        "weight_sync/num_buckets": float(num_buckets),
        "weight_sync/num_engines": float(num_engines),
        "weight_sync/gib_per_s": num_bytes / seconds / (1 << 30) if seconds > 0 else float("inf"),
        "weight_sync/version": float(version),
    }
