"""Weight sync: HF-named full tensors from the actor, in buckets, into every rollout engine.

Input is any iterable of ``(hf_name, tensor)`` -- the actor's
``iter_hf_weights(bucket_bytes=...)``, a safetensors file, a ``state_dict().items()`` --
so the sync knows nothing about Megatron and the actor knows nothing about engines.

CPU path (implemented, tested). Tensors are grouped into buckets of about ``bucket_mb``
MiB (:class:`WeightBucket`: a table of name, dtype and shape plus one raw-byte numpy
array per tensor). Each bucket is ``ray.put`` once; every engine receives the same
``ObjectRef``, maps the arrays zero-copy from the shared-memory object store and copies
the tensors into its parameters. Numpy rather than torch because Ray serialises numpy
buffers out-of-band (pickle protocol 5): ``ray.put`` is the only copy the driver makes
of a host tensor, and ``ray.get`` makes none; a torch tensor would be pickled into the
byte stream and copied again on every engine. So the driver writes each byte once into
the object store whatever the number of engines, and holds at most
``max_inflight_buckets`` buckets beyond the ones the pool keeps for restarts.

Why buckets rather than one object per tensor: a few large object-store entries instead
of hundreds of small ones (a Qwen2-7B sync is ~30 buckets of 512 MiB instead of ~340
tensors), and the producer (the actor gathering TP/PP shards) runs one bucket ahead of
the engines. An earlier version packed each bucket into one flat buffer first; on this
CPU that extra copy into freshly allocated memory cost more than the whole ``ray.put``.

GPU paths (designed, not implemented here; see docs/rollout.md): disaggregated engines
receive buckets by NCCL broadcast from actor rank 0 in a process group spanning the
actor's rank 0 and every engine worker; colocated engines receive CUDA IPC handles of a
bucket already on the same GPU. Both keep the bucket format and the engine-side
``load_bucket`` of this module; only the transport changes.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from megatron_rl.rollout.pool import RolloutPool

__all__ = ["WeightBucket", "bucket_named_tensors", "make_bucket", "sync_weights", "unpack_bucket"]

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


def sync_weights(
    pool: RolloutPool,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    version: int,
    bucket_mb: float = 512,
    max_inflight_buckets: int = 2,
) -> dict[str, Any]:
    """Send every tensor to every engine of ``pool`` through the Ray object store.

    Args:
        pool: the engines to update (all of them get every tensor).
        named_tensors: HF-named full tensors, e.g. the actor's ``iter_hf_weights()``;
            consumed once, lazily (a bucket is put while earlier ones are loading). A
            yielded tensor must stay unchanged until the sync returns: host tensors are
            put without a copy, and bucketing reads one tensor ahead (do not yield a
            reused gather buffer).
        version: weight version the engines report afterwards (and tag completions with).
        bucket_mb: bucket size in MiB (``rollout.weight_sync_bucket_mb``).
        max_inflight_buckets: buckets being loaded at once; bounds the driver's extra
            memory at about ``max_inflight_buckets * bucket_mb`` (plus the buckets the
            pool keeps to restore a restarted engine, see ``PoolOptions``).

    Returns:
        Stats: ``weight_sync/seconds`` (wall time, producer included),
        ``weight_sync/put_seconds`` (host copies + ``ray.put`` on the driver),
        ``weight_sync/bytes`` (payload bytes sent to each engine), ``weight_sync/num_tensors``,
        ``weight_sync/num_buckets``, ``weight_sync/num_engines``,
        ``weight_sync/gib_per_s`` and ``weight_sync/version``.
    """
    import ray

    if max_inflight_buckets < 1:
        raise ValueError(f"max_inflight_buckets: got {max_inflight_buckets}; must be >= 1")
    start = time.perf_counter()
    put_seconds = 0.0
    num_bytes = num_tensors = num_buckets = 0
    bucket_refs: list[ray.ObjectRef] = []
    inflight: list[list[tuple[int, ray.ObjectRef]]] = []  # per bucket: (engine, load ref)
    pool.begin_weight_update(version)
    try:
        for tensors in bucket_named_tensors(named_tensors, int(bucket_mb * MIB)):
            while len(inflight) >= max_inflight_buckets:
                pool.wait_weight_loads(inflight.pop(0))
            t0 = time.perf_counter()
            bucket = make_bucket(tensors)
            ref = ray.put(bucket)
            num_tensors += len(bucket.entries)
            num_bytes += bucket.num_bytes
            num_buckets += 1
            del bucket, tensors  # the object store holds the only copy from here on
            put_seconds += time.perf_counter() - t0
            inflight.append(pool.load_bucket_everywhere(ref, version))
            bucket_refs.append(ref)
        for loads in inflight:
            pool.wait_weight_loads(loads)
    except BaseException:
        pool.abort_weight_update()
        raise
    pool.finish_weight_update(version, bucket_refs)
    seconds = time.perf_counter() - start
    result = {
        "weight_sync/seconds": seconds,
        "weight_sync/put_seconds": put_seconds,
        "weight_sync/bytes": num_bytes,
        "weight_sync/num_tensors": num_tensors,
        "weight_sync/num_buckets": num_buckets,
        "weight_sync/num_engines": pool.num_engines,
        "weight_sync/gib_per_s": num_bytes / seconds / (1 << 30) if seconds > 0 else float("inf"),
        "weight_sync/version": int(version),
    }
    logger.info(
        "weight sync v%d: %.3f GiB in %d buckets to %d engines in %.2fs",
        version, num_bytes / (1 << 30), num_buckets, pool.num_engines, seconds,
    )  # fmt: skip
    return result
