"""The shared-memory weight transport's file (``weight_sync/transports/shm.py``): what actor rank
0 writes is what an engine process reads, bit for bit, for every dtype; the two slots
alternate, so a version stays intact while the next one is written; a tensor that does
not match the layout is refused; a ``/dev/shm`` too small is an error naming the sizes
before anything is written; :meth:`close` removes the file."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
from collections import namedtuple

import pytest
import torch

from megatron_rl.weight_sync.buckets import WeightBucket, unpack_bucket
from megatron_rl.weight_sync.meta import TensorMeta
from megatron_rl.weight_sync.transports import shm

pytestmark = pytest.mark.skipif(not shm.SHM_DIR.is_dir(), reason="no /dev/shm on this host")


def _tensors(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("model.embed_tokens.weight", torch.randn(37, 8, generator=g)),
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(8, 8, generator=g).to(torch.bfloat16)),
        ("model.layers.0.input_layernorm.weight", torch.randn(3, generator=g).to(torch.float16)),  # 6 bytes: unaligned
        ("model.norm.weight", torch.randn(8, generator=g).double()),
        ("lm_head.weight", torch.randn(37, 8, generator=g)[:, ::2]),  # strided
    ]


def _summary(named) -> list[tuple[str, str, tuple[int, ...], str]]:
    """Name, dtype, shape and SHA-256 of the bytes of each tensor."""
    return [(n, str(t.dtype), tuple(t.shape), hashlib.sha256(t.contiguous().view(torch.uint8).numpy()).hexdigest())
            for n, t in named]  # fmt: skip


def _read_in_child(descriptor: shm.SharedBucket, queue) -> None:
    # What an engine's worker does with the descriptor (rollout.pool.worker.EngineWorker.load_bucket).
    bucket = WeightBucket(entries=list(descriptor.entries), arrays=descriptor.arrays())
    queue.put(_summary(unpack_bucket(bucket)))


def test_another_process_reads_every_version_bit_for_bit_and_slots_alternate():
    first, second = _tensors(0), _tensors(1)
    writer = shm.SharedWeightsWriter([TensorMeta.of(n, t) for n, t in first])
    try:
        a = writer.write(first)
        b = writer.write(second)
        assert a.offsets != b.offsets and a.path == b.path == str(writer.path)
        ctx = mp.get_context("spawn")
        for descriptor, want in ((a, first), (b, second)):  # the first version is intact after the second
            queue = ctx.Queue()
            child = ctx.Process(target=_read_in_child, args=(descriptor, queue))
            child.start()
            got = queue.get(timeout=120)
            child.join()
            assert got == _summary(want)
        assert all(o % 64 == 0 for o in a.offsets + b.offsets)
        assert writer.write(first) == a  # the third write reuses the first slot
    finally:
        writer.close()
    assert not writer.path.exists()
    writer.close()  # twice is harmless


def test_a_tensor_that_does_not_match_the_layout_is_refused():
    tensors = _tensors(0)
    writer = shm.SharedWeightsWriter([TensorMeta.of(n, t) for n, t in tensors])
    try:
        with pytest.raises(ValueError, match="at position 1"):
            writer.write([tensors[0], (tensors[1][0], tensors[1][1].float()), *tensors[2:]])
        with pytest.raises(ValueError, match="3 tensors written, the layout has 5"):
            writer.write(tensors[:3])
        with pytest.raises(ValueError, match="more tensors than the layout's 5"):
            writer.write([*tensors, ("extra", torch.zeros(1))])
    finally:
        writer.close()


def test_too_little_room_is_an_error_naming_the_sizes_and_leaves_no_file(monkeypatch, tmp_path):
    Stat = namedtuple("Stat", "f_bavail f_frsize")
    monkeypatch.setattr(os, "statvfs", lambda _: Stat(f_bavail=16, f_frsize=4096))  # 64 KiB free
    metas = [TensorMeta("w", "float32", (1024, 64))]  # 256 KiB, two slots: 512 KiB
    with pytest.raises(OSError, match="0 MiB free; two copies of the model's weights need 0 MiB"):
        shm.SharedWeightsWriter(metas, directory=tmp_path)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(OSError, match="no .* on this host"):
        shm.SharedWeightsWriter(metas, directory=tmp_path / "missing")
