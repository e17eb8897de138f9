"""What the actor writes besides the tensors (``megatron_rl/actor/checkpoint/save_load.py``): the RNG files
are tensors and numbers only and load with ``weights_only=True``, so a crafted pickle in a
checkpoint is refused instead of run; the finiteness check of the parameters."""

from __future__ import annotations

import random
import warnings

import numpy as np
import pytest
import torch

from megatron_rl.actor.checkpoint import rng
from megatron_rl.actor.checkpoint import save_load as ckpt


class _Payload:
    """Unpickling this calls ``open(marker, "w")``: a stand-in for any code a pickle may run."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_crafted_rng_file_is_refused_and_runs_nothing(tmp_path):
    marker, path = tmp_path / "pwned", tmp_path / "rank0.pt"
    torch.save({"layout": {"tp": 1, "pp": 1, "dp": 1}, "state": _Payload(marker)}, path)
    with pytest.warns(UserWarning, match="not a tensor-only RNG file, so it was not unpickled"):
        assert rng.load_rng_file(path) is None
    assert not marker.exists()
    torch.load(path, weights_only=False)  # what the old loader did: the payload is live
    assert marker.exists()


def test_rng_state_round_trips_through_a_weights_only_file(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    path = tmp_path / "rank0.pt"
    torch.save({"layout": {"tp": 1, "pp": 1, "dp": 1}, "state": rng.rng_state()}, path)
    expected = (random.random(), float(np.random.rand()), torch.rand(1).item(), np.random.randn())
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a weights_only refusal would warn
        rng.set_rng_state(rng.load_rng_file(path))
    assert (random.random(), float(np.random.rand()), torch.rand(1).item(), np.random.randn()) == expected


class _FakeDist:
    """``dist.all_reduce`` of one process (the check is collective)."""

    class ReduceOp:
        MAX = "max"

    @staticmethod
    def all_reduce(tensor, op=None):
        return tensor


@pytest.mark.parametrize("value, ok", [(1.0, True), (float("nan"), False), (float("inf"), False), (1e30, False)])
def test_parameters_must_be_finite_and_not_overflow_float32(monkeypatch, value, ok):
    monkeypatch.setattr(ckpt, "dist", _FakeDist)
    model = torch.nn.Linear(4, 4)
    with torch.no_grad():
        model.weight[1, 2] = value
    if ok:
        ckpt.check_finite_parameters(model)
    else:
        with pytest.raises(ckpt.NonFiniteWeightsError, match="not written"):
            ckpt.check_finite_parameters(model)
