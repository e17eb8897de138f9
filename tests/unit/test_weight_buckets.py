"""Bucketing and the bucket format of the weight sync (the Ray path is in tests/distributed)."""

import pickle

import pytest
import torch

from megatron_rl.weight_sync.buckets import bucket_named_tensors, make_bucket, unpack_bucket


def _named(sizes):
    return [(f"t{i}", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate(sizes)]


def test_buckets_respect_size_and_order():
    # float32: 4 bytes per element; a 40-byte budget holds 10 elements.
    buckets = list(bucket_named_tensors(_named([4, 4, 4, 20, 1, 9]), 40))
    assert [[name for name, _ in b] for b in buckets] == [["t0", "t1"], ["t2"], ["t3"], ["t4", "t5"]]
    assert list(bucket_named_tensors([], 40)) == []
    with pytest.raises(ValueError):
        list(bucket_named_tensors(_named([1]), 0))


def test_bucketing_is_lazy():
    consumed = []

    def producer():
        for i in range(4):
            consumed.append(i)
            yield f"t{i}", torch.zeros(10)

    it = bucket_named_tensors(producer(), 40)
    next(it)
    # The first bucket is yielded once the second tensor does not fit: 2 tensors read, not 4.
    assert consumed == [0, 1]


def test_bucket_round_trip_is_bit_exact_for_every_layout():
    base = torch.randn(6, 5)
    tensors = [
        ("w.f32", torch.randn(3, 7)),
        ("w.bf16", torch.randn(4, 3).to(torch.bfloat16)),
        ("w.f16", torch.randn(5).to(torch.float16)),
        ("w.i64", torch.arange(7)),
        ("w.scalar", torch.tensor(3.5)),
        ("w.strided", base.t()),  # non-contiguous
        ("w.empty", torch.zeros(0, 4)),
    ]
    bucket = make_bucket(tensors)
    assert bucket.num_bytes == sum(t.numel() * t.element_size() for _, t in tensors)
    # Through pickle protocol 5 with out-of-band buffers, as Ray serialises it.
    buffers = []
    data = pickle.dumps(bucket, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == len(tensors)  # every array travels out-of-band (no copy into the stream)
    restored = unpack_bucket(pickle.loads(data, buffers=buffers))
    assert [n for n, _ in restored] == [n for n, _ in tensors]
    for (_, want), (_, got) in zip(tensors, restored):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)


def test_host_tensors_are_not_copied_into_the_bucket():
    tensor = torch.randn(16)
    bucket = make_bucket([("w", tensor)])
    assert bucket.arrays[0].ctypes.data == tensor.data_ptr()
