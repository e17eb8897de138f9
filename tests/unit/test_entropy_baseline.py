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


def test_after_megatrons_in_place_cross_entropy_the_loss_equals_the_fused_op():
    """fused_loss.py's megatron_careful order: the entropy, then megatron's cross-entropy,
    which overwrites float32 logits in place with its softmax (the entropy's backward does
    not read them). Loss and logits gradient equal the fused op's on the same inputs."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from megatron_rl.algo import AlgorithmConfig, compute_policy_loss
    from megatron_rl.ops import LossInputs, VocabParallelOptions, fused_policy_loss

    created = not dist.is_initialized()
    if created:  # one process: an in-memory store, no TCP port to pick
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        g = torch.Generator().manual_seed(1)
        num_tokens, vocab = 300, 120
        z = torch.randn(num_tokens, vocab, generator=g) * 3
        targets = torch.randint(0, vocab, (num_tokens,), generator=g)
        old = -torch.rand(num_tokens, generator=g) * 5
        adv = torch.randn(num_tokens, generator=g)
        mask = torch.rand(num_tokens, generator=g) > 0.2
        cfg = AlgorithmConfig(kl_coef=0.01, entropy_coef=0.05)
        inputs = LossInputs(targets=targets, old_logp=old, advantages=adv, mask=mask, ref_logp=old + 0.1)

        careful = z.clone().requires_grad_()
        entropy = _module().entropy_one_buffer(careful)
        logp = -vocab_parallel_cross_entropy(careful, targets)
        out = compute_policy_loss(logp, old, adv, mask, cfg, ref_logp=old + 0.1, entropy=entropy)
        out.loss_sum.backward()

        fused = z.clone().requires_grad_()
        want, _ = fused_policy_loss(fused, inputs, cfg, VocabParallelOptions())
        want.loss_sum.backward()
        assert float(out.loss_sum) == pytest.approx(float(want.loss_sum), rel=1e-5, abs=1e-5)
        torch.testing.assert_close(careful.grad, fused.grad, atol=1e-5, rtol=1e-4)
    finally:
        parallel_state.destroy_model_parallel()
        if created:
            dist.destroy_process_group()
