"""The fused vocab-parallel policy loss on one rank against the naive float64 reference.

Multi-rank (TP = 2, 4) cases are in tests/distributed/test_fused_loss_tp.py.
"""

import pytest
import torch

from megatron_rl.algo import AlgorithmConfig, TRGRPOConfig, finalize_metrics
from megatron_rl.ops import (
    LossInputs,
    VocabParallelOptions,
    fused_linear_policy_loss,
    fused_policy_loss,
    vocab_parallel_logprobs,
    vocab_parallel_logprobs_from_hidden,
)
from tests.fused_reference import make_inputs, make_linear_inputs, naive_logp_entropy, naive_loss
from tests.loss_cases import LOSS_CASES, lopti_phase_for

TOL = {torch.float64: 1e-12, torch.float32: 1e-5}


def run_fused(logits, targets, mask, old, ref, adv, cfg, *, phase=None, **opts):
    x = logits.detach().clone().requires_grad_()
    inputs = LossInputs(targets=targets, old_logp=old, advantages=adv, mask=mask, ref_logp=ref, phase=phase)
    out, stats = fused_policy_loss(x, inputs, cfg, VocabParallelOptions(**opts))
    loss = out.loss_sum / out.count.to(out.loss_sum.dtype)
    loss.backward()
    return loss.detach(), x.grad, stats, out


@pytest.mark.parametrize("name", list(LOSS_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_tokens", [5, None])  # 5 does not divide the 21 tokens
def test_matches_naive_float64_reference(name, dtype, temperature, chunk_tokens):
    cfg = LOSS_CASES[name]
    phase = lopti_phase_for(name, cfg)
    logits, targets, mask, old, ref, adv = make_inputs(seed=len(name), dtype=dtype)
    want, want_grad, want_lp, want_h, want_m = naive_loss(
        logits, targets, mask, old, ref, adv, cfg, temperature=temperature, phase=phase
    )
    got, grad, stats, out = run_fused(
        logits, targets, mask, old, ref, adv, cfg, phase=phase, temperature=temperature, chunk_tokens=chunk_tokens
    )
    assert grad.dtype == dtype
    assert float(got) == pytest.approx(float(want), abs=1e-5, rel=1e-5)
    valid = mask.reshape(-1)
    torch.testing.assert_close(stats.logp[valid].double(), want_lp.reshape(-1)[valid], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stats.entropy[valid].double(), want_h.reshape(-1)[valid], atol=1e-5, rtol=1e-5)
    if dtype == torch.float32:
        torch.testing.assert_close(grad.double(), want_grad, atol=1e-5, rtol=1e-5)
    else:  # the gradient is returned in the logits' dtype: bf16 rounding (8 bits of mantissa)
        torch.testing.assert_close(grad.double(), want_grad, atol=1e-5, rtol=1.6e-2)
    got_m, ref_m = finalize_metrics(out.metrics), finalize_metrics(want_m)
    assert got_m.keys() == ref_m.keys()
    for k in ref_m:
        assert got_m[k] == pytest.approx(ref_m[k], abs=1e-5), k


def test_float64_is_exact_and_padding_gets_zero_gradient():
    cfg = LOSS_CASES["all_composed"]
    logits, targets, mask, old, ref, adv = make_inputs(seed=3, dtype=torch.float64)
    want, want_grad, *_ = naive_loss(logits, targets, mask, old, ref, adv, cfg, temperature=0.6, phase="low")
    got, grad, _, _ = run_fused(logits, targets, mask, old, ref, adv, cfg, phase="low", temperature=0.6, chunk_tokens=4)
    assert float(got) == pytest.approx(float(want), abs=1e-12)
    torch.testing.assert_close(grad, want_grad, atol=1e-12, rtol=1e-10)
    assert not mask.all() and grad[~mask].abs().max() == 0


def test_gradcheck_float64():
    """torch.autograd.gradcheck on a tiny case (no stop-gradient weights: finite differences
    would see TR-GRPO/STAPO weights move, which the loss by design does not differentiate)."""
    cfg = AlgorithmConfig(kl_coef=0.3, entropy_coef=0.1, aggregation="seq_mean_token_mean")
    logits, targets, mask, old, ref, adv = make_inputs(seed=5, rows=2, cols=3, vocab=6, dtype=torch.float64)
    inputs = LossInputs(targets=targets, old_logp=old, advantages=adv, mask=mask, ref_logp=ref)
    opts = VocabParallelOptions(temperature=0.8, chunk_tokens=2, grad_in_place=False)

    def f(x):
        return fused_policy_loss(x, inputs, cfg, opts)[0].loss_sum

    assert torch.autograd.gradcheck(f, (logits.clone().requires_grad_(),), eps=1e-6, atol=1e-8)


def test_vocab_padding_columns_are_excluded():
    cfg = LOSS_CASES["grpo_kl_k3_entropy"]
    logits, targets, mask, old, ref, adv = make_inputs(seed=7, vocab=37)
    padded = torch.cat([logits, torch.full(logits.shape[:-1] + (3,), 50.0)], dim=-1)  # garbage columns
    want, want_grad, *_ = naive_loss(logits, targets, mask, old, ref, adv, cfg, temperature=1.0)
    got, grad, _, _ = run_fused(padded, targets, mask, old, ref, adv, cfg, vocab_size=37, chunk_tokens=4)
    assert float(got) == pytest.approx(float(want), abs=1e-5)
    torch.testing.assert_close(grad[..., :37].double(), want_grad, atol=1e-5, rtol=1e-5)
    assert grad[..., 37:].abs().max() == 0


def test_forward_only_logprobs_and_entropy():
    logits, targets, mask, *_ = make_inputs(seed=8, dtype=torch.bfloat16)
    lp, h = vocab_parallel_logprobs(
        logits, targets, mask=mask, options=VocabParallelOptions(temperature=0.7, chunk_tokens=3)
    )
    want_lp, want_h = naive_logp_entropy(logits, targets, 0.7)
    assert lp.dtype == torch.float32 and lp.shape == targets.shape
    torch.testing.assert_close(lp[mask].double(), want_lp[mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h[mask].double(), want_h[mask], atol=1e-5, rtol=1e-5)
    assert (lp[~mask] == 0).all() and (h[~mask] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", ["grpo_kl_k3_entropy", "stapo", "all_composed", "seq_mean"])
def test_fused_linear_matches_unfused(name, dtype):
    cfg = LOSS_CASES[name]
    phase = lopti_phase_for(name, cfg)
    _, targets, mask, old, ref, adv = make_inputs(seed=11)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 7, 16, generator=g, dtype=torch.float64).to(dtype)
    weight = (0.5 * torch.randn(37, 16, generator=g, dtype=torch.float64)).to(dtype)
    inputs = LossInputs(targets=targets, old_logp=old, advantages=adv, mask=mask, ref_logp=ref, phase=phase)
    opts = VocabParallelOptions(temperature=0.9, chunk_tokens=4)

    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out1, _ = fused_policy_loss(h1 @ w1.t(), inputs, cfg, opts)  # autograd through the matmul
    (out1.loss_sum / out1.count.to(dtype)).backward()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out2, _ = fused_linear_policy_loss(h2, w2, inputs, cfg, opts)
    (out2.loss_sum / out2.count.to(dtype)).backward()

    tol = TOL[dtype]
    assert float(out2.loss_sum.detach()) == pytest.approx(float(out1.loss_sum.detach()), abs=tol, rel=tol)
    torch.testing.assert_close(h2.grad, h1.grad, atol=tol, rtol=tol)
    torch.testing.assert_close(w2.grad, w1.grad, atol=tol, rtol=tol)
    lp, ent = vocab_parallel_logprobs_from_hidden(hidden, weight, targets, mask=mask, options=opts)
    want_lp, want_h = naive_logp_entropy(hidden.double() @ weight.double().t(), targets, 0.9)
    torch.testing.assert_close(lp[mask].double(), want_lp[mask], atol=tol, rtol=tol)
    torch.testing.assert_close(ent[mask].double(), want_h[mask], atol=tol, rtol=tol)


def test_bad_inputs_are_named():
    logits, targets, mask, old, ref, adv = make_inputs(seed=1)
    bad = targets.clone()
    bad[1, 0] = 37  # valid token, id out of range
    with pytest.raises(ValueError, match="target id 37 at token 7"):
        run_fused(logits, bad, mask, old, ref, adv, AlgorithmConfig())
    with pytest.raises(ValueError, match="inputs.old_logp has shape"):
        run_fused(logits, targets, mask, old[:, :3], ref, adv, AlgorithmConfig())
    with pytest.raises(ValueError, match="vocab_size=40 does not fit"):
        run_fused(logits, targets, mask, old, ref, adv, AlgorithmConfig(), vocab_size=40)


def test_second_backward_is_refused_not_wrong():
    logits, targets, mask, old, ref, adv = make_inputs(seed=2)
    x = logits.clone().requires_grad_()
    inputs = LossInputs(targets=targets, old_logp=old, advantages=adv, mask=mask)
    out, _ = fused_policy_loss(x, inputs, AlgorithmConfig())
    out.loss_sum.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward per forward"):
        out.loss_sum.backward()


def test_no_gradient_pass_without_grad():
    logits, targets, mask, old, ref, adv = make_inputs(seed=2)
    inputs = LossInputs(targets=targets, old_logp=old, advantages=adv, mask=mask)
    out, _ = fused_policy_loss(logits, inputs, AlgorithmConfig(tr_grpo=TRGRPOConfig(enabled=True)))
    assert not out.loss_sum.requires_grad and torch.isfinite(out.loss_sum)


def test_fused_linear_accumulates_into_main_grad():
    """Megatron-style ``main_grad``: dL/dW (unscaled loss sum) is added to the buffer."""
    cfg = LOSS_CASES["grpo_kl_k3_entropy"]
    hidden, weight, inputs, _ = make_linear_inputs(12, 1)
    w1 = weight.clone().requires_grad_()
    out1, _ = fused_linear_policy_loss(hidden, w1, inputs, cfg)
    out1.loss_sum.backward()
    main_grad = torch.full_like(weight, 0.25)  # already holds an earlier micro-batch's gradient
    w2 = weight.clone().requires_grad_()
    h2 = hidden.clone().requires_grad_()
    out2, _ = fused_linear_policy_loss(h2, w2, inputs, cfg, weight_main_grad=main_grad)
    out2.loss_sum.backward()
    assert w2.grad is None and h2.grad is not None
    torch.testing.assert_close(main_grad, w1.grad + 0.25, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("name", ["grpo_kl_k3_entropy", "all_composed"])
def test_token_grad_norms_equal_rowwise_norm_of_the_loss_sum_gradient(name):
    cfg = LOSS_CASES[name]
    phase = lopti_phase_for(name, cfg)
    logits, targets, mask, old, ref, adv = make_inputs(seed=13, dtype=torch.float64)
    x = logits.clone().requires_grad_()
    inputs = LossInputs(targets=targets, old_logp=old, advantages=adv, mask=mask, ref_logp=ref, phase=phase)
    out, stats = fused_policy_loss(
        x, inputs, cfg, VocabParallelOptions(temperature=0.8, chunk_tokens=4, token_grad_norms=True)
    )
    out.loss_sum.backward()  # unscaled: the norms are of the loss SUM's gradient
    want = x.grad.reshape(-1, x.shape[-1]).norm(dim=-1)
    torch.testing.assert_close(stats.logit_grad_norm, want, atol=1e-12, rtol=1e-10)
    assert stats.logit_grad_norm[mask.reshape(-1)].min() >= 0 and (stats.logit_grad_norm[~mask.reshape(-1)] == 0).all()


def test_fused_linear_bf16_runs_its_matmuls_in_bf16_and_accumulates_in_float32():
    """bf16 hidden states and weight (as on GPUs): the loss and gradients equal the float64
    math on the same bf16 values within bf16 rounding, and a main_grad stays float32."""
    cfg = LOSS_CASES["grpo_kl_k3_entropy"]
    _, targets, mask, old, ref, adv = make_inputs(seed=14)
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(3, 7, 16, generator=g).to(torch.bfloat16)
    weight = (0.5 * torch.randn(37, 16, generator=g)).to(torch.bfloat16)
    inputs = LossInputs(targets=targets, old_logp=old, advantages=adv, mask=mask, ref_logp=ref)
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    want, _ = fused_policy_loss(h64 @ w64.t(), inputs, cfg, VocabParallelOptions(chunk_tokens=4))
    want.loss_sum.backward()
    h = hidden.clone().requires_grad_()
    main_grad = torch.zeros(weight.shape, dtype=torch.float32)
    out, _ = fused_linear_policy_loss(h, weight.clone(), inputs, cfg, VocabParallelOptions(chunk_tokens=4),
                                      weight_main_grad=main_grad)  # fmt: skip
    out.loss_sum.backward()
    assert h.grad.dtype == torch.bfloat16 and main_grad.dtype == torch.float32
    assert float(out.loss_sum.detach()) == pytest.approx(float(want.loss_sum.detach()), rel=2e-2, abs=2e-2)
    torch.testing.assert_close(h.grad.double(), h64.grad, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(main_grad.double(), w64.grad, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("name", list(LOSS_CASES))
def test_on_policy_old_logp_none_equals_the_naive_loss_at_the_current_logprobs(name):
    """``old_logp=None`` (an on-policy update's first step): the old log-probs are the
    current ones, so the loss and gradient equal the float64 reference given
    ``old = log_softmax(logits / T)[target]``, and every ratio is exactly 1."""
    cfg = LOSS_CASES[name]
    if cfg.ar.enabled:
        pytest.skip("AR reweights advantages from old_logp before the loss (the actor never passes None then)")
    phase = lopti_phase_for(name, cfg)
    logits, targets, mask, _, ref, adv = make_inputs(seed=len(name), dtype=torch.float64)
    current, _ = naive_logp_entropy(logits, targets, 0.7)
    want, want_grad, _, _, want_m = naive_loss(logits, targets, mask, current, ref, adv, cfg, temperature=0.7,
                                                phase=phase)  # fmt: skip
    got, grad, _, out = run_fused(logits, targets, mask, None, ref, adv, cfg, phase=phase, temperature=0.7)
    assert float(got) == pytest.approx(float(want), abs=1e-12, rel=1e-12)
    torch.testing.assert_close(grad, want_grad, atol=1e-12, rtol=1e-12)
    got_m, ref_m = finalize_metrics(out.metrics), finalize_metrics(want_m)
    for k in ref_m:
        assert got_m[k] == pytest.approx(ref_m[k], abs=1e-12), k
