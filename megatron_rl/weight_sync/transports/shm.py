"""The ``shared_memory`` weight transport: one host shared-memory file per run, written by
actor rank 0 and mapped by every engine on its node.

The object store moves a version in three copies and two process hops: rank 0 serialises
each bucket into Ray's store, Ray tells the consumer, and the engine copies the mapped
bytes into its parameters. On one node the first two cost more than the bytes: on the
vs-TRL benchmark's 3.2 MB model, 6 ms from the sync's start to the first bucket, of a
9.5 ms sync on the step's critical path (``docs/benchmarks.md``). Here rank 0 copies the
HF-named tensors straight into a file in ``/dev/shm`` that it created once (the layout
fixed by the version's metadata), and every engine copies them out of its own mapping of
that file, through the same ``RolloutEngine.load_bucket`` as an object-store bucket: the
pools pass a :class:`SharedBucket` (a small descriptor) where they would pass a bucket.

- Writer (:class:`SharedWeightsWriter`): rank 0 only; the file is named after its
  process (``megatron_rl_weights_<pid>_<hex>``, the reaper's convention), so the run's
  reaper removes it when a killed run leaves it behind (``cli/reaper.py``);
  :meth:`close` removes it.
- Reader (:meth:`SharedBucket.arrays`): maps the file read-only (the mapping is kept
  per process for the next version) and returns zero-copy byte views, the arrays of a
  :class:`~megatron_rl.weight_sync.buckets.WeightBucket` with the same entries.

The file has two slots, written in turn: the trainer queues a version's write right
behind its update (``WeightSync.prepare``), so the actor writes while the engines may
still generate on, or be restored from, the previous version, which stays intact in the
other slot until the write after next; the pool's kept descriptor (what a restarted
engine loads, like the object store's kept buckets) names the slot of its version.
Engines on another node cannot map the file: ``weight_sync.WeightSync`` checks the nodes
first.
"""

from __future__ import annotations

import mmap
import os
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from megatron_rl.weight_sync.meta import TensorMeta

__all__ = ["SHM_DIR", "SharedBucket", "SharedWeightsWriter"]

SHM_DIR = Path("/dev/shm")
_ALIGN = 64  # every tensor starts on a cache line


@dataclass(frozen=True)
class SharedBucket:
    """Where one version's tensors lie in the shared file (sent to the engines instead of a bucket).

    ``entries[i] = (name, dtype name, shape)`` at byte ``offsets[i]`` of ``path``, in the
    order of the sync's metadata."""

    path: str
    entries: tuple[tuple[str, str, tuple[int, ...]], ...]
    offsets: tuple[int, ...]
    num_bytes: int
    """The file's size."""

    def arrays(self) -> list[np.ndarray]:
        """Each tensor's bytes, a read-only ``uint8`` view into this process's mapping of
        the file (valid until :meth:`arrays` of another file)."""
        data = _map(self.path, self.num_bytes)
        return [data[offset : offset + TensorMeta(name, dtype, shape).num_bytes]
                for (name, dtype, shape), offset in zip(self.entries, self.offsets)]  # fmt: skip


_mapped: dict[str, np.ndarray] = {}


def _map(path: str, num_bytes: int) -> np.ndarray:
    """The whole file as a read-only ``uint8`` array; one mapping per process, replaced
    when another file (a new run's writer) comes."""
    data = _mapped.get(path)
    if data is None or data.size != num_bytes:
        _mapped.clear()
        data = np.memmap(path, dtype=np.uint8, mode="r", shape=(num_bytes,))
        _mapped[path] = data
    return data


class SharedWeightsWriter:
    """Actor rank 0's end: the shared file laid out for ``metas``, written once per version.

    Raises:
        OSError: ``directory`` is missing, or has less free space than twice the model's
            bytes (a container's 64 MiB ``/dev/shm``, say), naming both numbers.
    """

    def __init__(self, metas: list[TensorMeta], *, directory: Path = SHM_DIR):
        entries, offsets, offset = [], [], 0
        for m in metas:
            offset = -(-offset // _ALIGN) * _ALIGN
            entries.append((m.name, m.dtype, tuple(m.shape)))
            offsets.append(offset)
            offset += m.num_bytes
        slot = -(-max(offset, 1) // _ALIGN) * _ALIGN  # mmap refuses an empty file
        size = 2 * slot
        if not directory.is_dir():
            raise OSError(f"no {directory} on this host for the shared-memory weight transport")
        stat = os.statvfs(directory)
        free = stat.f_bavail * stat.f_frsize
        if free < size:
            raise OSError(f"{directory} has {free / 2**20:.0f} MiB free; two copies of the model's weights "
                          f"need {size / 2**20:.0f} MiB")  # fmt: skip
        self.path = directory / f"megatron_rl_weights_{os.getpid()}_{secrets.token_hex(4)}"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # Reserve the pages now: a tmpfs that fills up later would SIGBUS the writer
            # instead of raising here.
            os.posix_fallocate(fd, 0, size)
            self._mmap = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            raise
        os.close(fd)  # the mapping keeps the file open
        self._data = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self.slots = [
            SharedBucket(path=str(self.path), entries=tuple(entries), offsets=tuple(o + base for o in offsets),
                         num_bytes=size)  # fmt: skip
            for base in (0, slot)
        ]
        """The descriptors of the two slots."""
        self._next_slot = 0

    def write(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> SharedBucket:
        """Copy one version's tensors (in the metadata's order) into the next slot; its descriptor.

        Raises:
            ValueError: a tensor's name, dtype or shape is not the layout's, or the count differs.
        """
        layout = self.slots[self._next_slot]
        self._next_slot = 1 - self._next_slot
        count = 0
        for name, tensor in named_tensors:
            if count == len(layout.entries):
                raise ValueError(f"shared weights: more tensors than the layout's {count} (next: {name!r})")
            want, offset = layout.entries[count], layout.offsets[count]
            got = (name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))
            if got != want:
                raise ValueError(f"shared weights: got {got}, the layout has {want} at position {count}")
            size = tensor.numel() * tensor.element_size()
            self._data[offset : offset + size].view(tensor.dtype).view(want[2]).copy_(tensor)
            count += 1
        if count != len(layout.entries):
            raise ValueError(f"shared weights: {count} tensors written, the layout has {len(layout.entries)}")
        return layout

    def close(self) -> None:
        """Unmap and remove the file (engines' mappings stay valid until they drop them)."""
        if self._mmap is None:
            return
        del self._data
        self._mmap.close()
        self._mmap = None
        self.path.unlink(missing_ok=True)
