"""``actor.model.frozen_fp8_scaling``: a forward-only pass of the trained policy leaves the
delayed FP8 scaling state of every Transformer-Engine module as it was.

Transformer Engine cannot be installed on these CPU machines, so the modules here are
stand-ins with TE's state contract (an ``fp8_meta`` dict; ``get_extra_state`` returns the
scaling state, ``set_extra_state`` puts it back, as a checkpoint does) whose forward moves
that state the way delayed scaling does. What this checks is the project's rule: which
modules are frozen, for which recipes, and that an exception inside the pass still
restores. With TE itself the rule has not run (docs/gpu.md).
"""

import pytest
import torch

from megatron_rl.actor.model import frozen_fp8_scaling
from megatron_rl.config.model import ModelOptions


class _ScaledLinear(torch.nn.Module):
    """Delayed scaling in miniature: each forward records its amax and moves the scale."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 4))
        self.fp8_meta = {"recipe": "delayed"}
        self.amax_history = torch.zeros(3)
        self.scale = torch.ones(())

    def forward(self, x):
        self.amax_history = torch.roll(self.amax_history, 1)
        self.amax_history[0] = x.abs().max()
        self.scale = 448.0 / self.amax_history.max()
        return x @ self.weight

    def get_extra_state(self):
        return {"amax_history": self.amax_history.clone(), "scale": self.scale.clone()}

    def set_extra_state(self, state):
        self.amax_history, self.scale = state["amax_history"].clone(), state["scale"].clone()


def _chunk():
    return torch.nn.Sequential(_ScaledLinear(), torch.nn.ReLU(), torch.nn.Sequential(_ScaledLinear()))


def _states(chunk):
    return [(m.amax_history.clone(), m.scale.clone()) for m in chunk.modules() if isinstance(m, _ScaledLinear)]


def _same(a, b):
    return all(torch.equal(x, y) and torch.equal(s, t) for (x, s), (y, t) in zip(a, b, strict=True))


def test_a_forward_only_pass_leaves_delayed_scaling_where_it_was():
    chunk = _chunk()
    chunk(torch.randn(2, 4))  # a training forward set some state
    before = _states(chunk)
    with frozen_fp8_scaling([chunk], options=ModelOptions(fp8="hybrid", fp8_recipe="delayed")):
        chunk(torch.randn(2, 4) * 10)
        assert not _same(_states(chunk), before)  # the pass itself moved the scales
    assert _same(_states(chunk), before)


def test_an_error_inside_the_pass_still_restores():
    chunk = _chunk()
    chunk(torch.randn(2, 4))
    before = _states(chunk)
    with pytest.raises(RuntimeError), frozen_fp8_scaling([chunk], options=ModelOptions(fp8="e4m3")):
        chunk(torch.randn(2, 4) * 10)
        raise RuntimeError("a failed pass")
    assert _same(_states(chunk), before)


@pytest.mark.parametrize(("fp8", "recipe"), [(None, "delayed"), ("e4m3", "tensorwise"), ("e4m3", "mxfp8")])
def test_without_delayed_scaling_nothing_is_taken_or_restored(fp8, recipe):
    chunk = _chunk()
    chunk(torch.randn(2, 4))
    with frozen_fp8_scaling([chunk], options=ModelOptions(fp8=fp8, fp8_recipe=recipe)):
        chunk(torch.randn(2, 4) * 10)
        moved = _states(chunk)
    assert _same(_states(chunk), moved)  # the pass's own update stays
