"""The SFT objective (``algo.sft``) through the fused vocab-parallel op, on one rank, against
torch's float64 cross-entropy of the masked tokens. The multi-rank layouts (TP/PP/DP and
micro-batches through ``MegatronActor.sft_step``) are in tests/distributed/test_actor.py."""

import pytest
import torch

from megatron_rl.algo import finalize_metrics
from megatron_rl.algo.sft import SFT_OBJECTIVE, compute_sft_loss
from megatron_rl.ops import LossInputs, VocabParallelOptions, fused_linear_policy_loss, fused_policy_loss
from tests.fused_reference import make_inputs


def reference(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 mean cross-entropy of the masked tokens and its gradient w.r.t. the logits."""
    x = logits.detach().double().requires_grad_()
    nll = torch.nn.functional.cross_entropy(x.reshape(-1, x.shape[-1]), targets.reshape(-1), reduction="none")
    loss = nll[mask.reshape(-1)].mean()
    loss.backward()
    return loss.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_tokens", [5, None])
def test_fused_sft_loss_is_the_float64_cross_entropy(dtype, chunk_tokens):
    logits, targets, mask, *_ = make_inputs(seed=4, dtype=dtype)
    want, want_grad = reference(logits, targets, mask)
    x = logits.detach().clone().requires_grad_()
    # Old log-probs and advantages are not the objective's: garbage there must change nothing.
    inputs = LossInputs(targets=targets, old_logp=torch.full(mask.shape, float("nan")), advantages=None, mask=mask)
    out, stats = fused_policy_loss(x, inputs, SFT_OBJECTIVE, VocabParallelOptions(chunk_tokens=chunk_tokens))
    (out.loss_sum / out.count.to(out.loss_sum.dtype)).backward()
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-5}[dtype]
    assert float(out.loss_sum.detach() / out.count) == pytest.approx(float(want), abs=tol, rel=tol)
    assert float(out.count) == float(mask.sum())
    metrics = finalize_metrics(out.metrics)
    assert metrics["loss/nll"] == pytest.approx(float(want), abs=tol, rel=tol)
    assert metrics["loss/active_tokens"] == float(mask.sum())
    rtol = 1.6e-2 if dtype == torch.bfloat16 else tol  # the gradient comes back in the logits' dtype
    torch.testing.assert_close(x.grad.double(), want_grad, atol=tol, rtol=rtol)
    assert (x.grad[~mask] == 0).all()  # prompt and padding positions take no gradient


def test_fused_linear_sft_loss_matches_autograd_through_the_lm_head():
    _, targets, mask, *_ = make_inputs(seed=7, dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(*targets.shape, 16, generator=g, dtype=torch.float64)
    weight = 0.5 * torch.randn(37, 16, generator=g, dtype=torch.float64)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    want = torch.nn.functional.cross_entropy((h @ w.t())[mask], targets[mask])
    want.backward()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    inputs = LossInputs(targets=targets, old_logp=None, advantages=None, mask=mask)
    out, _ = fused_linear_policy_loss(h2, w2, inputs, SFT_OBJECTIVE, VocabParallelOptions(chunk_tokens=4))
    (out.loss_sum / out.count).backward()
    assert float(out.loss_sum.detach() / out.count) == pytest.approx(float(want), abs=1e-12)
    torch.testing.assert_close(h2.grad, h.grad, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(w2.grad, w.grad, atol=1e-12, rtol=1e-12)


def test_split_sums_equal_the_whole():
    # The aggregation contract: sums and counts of any split add up to the whole's mean.
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(6, 9, generator=g, dtype=torch.float64) * 4
    mask = torch.rand(6, 9, generator=g) > 0.4
    logp[~mask] = float("nan")  # never read
    whole = compute_sft_loss(logp, mask)
    parts = [compute_sft_loss(logp[rows], mask[rows]) for rows in (slice(0, 1), slice(1, 4), slice(4, 6))]
    total = sum(p.loss_sum for p in parts) / sum(p.count for p in parts)
    assert float(total) == pytest.approx(float(whole.loss_sum / whole.count), abs=1e-14)
    assert float(whole.loss_sum / whole.count) == pytest.approx(float(-logp[mask].mean()), abs=1e-14)
    with pytest.raises(ValueError, match="one shape"):
        compute_sft_loss(logp, mask[:, :-1])
