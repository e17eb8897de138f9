"""The benchmarks' strong entropy baseline against float64 autograd (1 and 2 vocab shards)."""

import importlib.util
from pathlib import Path

import pytest
import torch

from tests.dist_utils import run_on_ranks

REPO = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location("entropy_baseline", REPO / "benchmarks" / "entropy_baseline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _reference(z: torch.Tensor, weights: torch.Tensor):
    z = z.double().requires_grad_()
    logp = torch.log_softmax(z, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    (entropy * weights.double()).sum().backward()
    return entropy.detach(), z.grad


def _inputs(dtype):
    g = torch.Generator().manual_seed(0)
    z = (torch.randn(2500, 96, generator=g) * 4).to(dtype)  # > 2 chunks of tokens; peaked rows
    return z, torch.randn(2500, generator=g)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 1e-4)])
def test_one_rank_matches_float64_autograd(dtype, tol):
    z, w = _inputs(dtype)
    ref_h, ref_grad = _reference(z, w)
    zz = z.clone().requires_grad_()
    h = _module().entropy_one_buffer(zz)
    (h * w).sum().backward()
    assert h.dtype == torch.float32 and zz.grad.dtype == dtype
    assert torch.allclose(h.double(), ref_h, atol=tol, rtol=tol)
    grad_tol = tol if dtype == torch.float32 else 1e-2  # bfloat16 gradient: 8 mantissa bits of values up to ~2.5
    assert torch.allclose(zz.grad.double(), ref_grad, atol=grad_tol, rtol=grad_tol)


def _sharded(rank, world, results):
    import torch.distributed as dist

    z, w = _inputs(torch.float32)
    shard = z.chunk(world, dim=-1)[rank].clone().requires_grad_()
    h = _module().entropy_one_buffer(shard, dist.group.WORLD)
    (h * w).sum().backward()
    results.append((rank, h.detach(), shard.grad))


def test_two_vocab_shards_match_float64_autograd():
    z, w = _inputs(torch.float32)
    ref_h, ref_grad = _reference(z, w)
    out = sorted(run_on_ranks(_sharded, 2), key=lambda r: r[0])
    for rank, h, grad in out:
        assert torch.allclose(h.double(), ref_h, atol=1e-4, rtol=1e-5)
        assert torch.allclose(grad.double(), ref_grad.chunk(2, dim=-1)[rank], atol=1e-4, rtol=1e-4)
