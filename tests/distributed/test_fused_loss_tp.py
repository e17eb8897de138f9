"""The fused op on 2 and 4 tensor-parallel gloo ranks equals the naive float64 reference
on the gathered logits: values, per-shard logit gradients, and in fused-linear mode the
TP-summed hidden-state gradient and each rank's weight-shard gradient; with the torch
kernel and with the Triton kernels."""

import importlib.util

import pytest
import torch
import torch.distributed as dist

from megatron_rl.algo import compute_policy_loss
from megatron_rl.ops import (
    LossInputs,
    VocabParallelOptions,
    fused_linear_policy_loss,
    fused_policy_loss,
    vocab_parallel_logprobs,
)
from tests.dist_utils import run_on_ranks
from tests.fused_reference import make_inputs, naive_logp_entropy, naive_loss
from tests.loss_cases import LOSS_CASES, lopti_phase_for

VOCAB, PADDED = 37, 40  # 40 columns split over TP; the last 3 are padding


def _shard(x, rank, world):
    width = x.shape[-1] // world
    return x[..., rank * width:(rank + 1) * width]


def _pad(logits, to):
    extra = torch.full(logits.shape[:-1] + (to - logits.shape[-1],), 30.0, dtype=logits.dtype)
    return torch.cat([logits, extra], dim=-1)


def _worker(rank, world, results, kernel="torch"):
    group = dist.group.WORLD
    report = results.append if rank == 0 else (lambda _: None)

    # every loss config, fp32 and (for a few) bf16, temperature 0.7, chunks of 5 of 21 tokens
    cases = [(n, torch.float32) for n in LOSS_CASES] + [
        (n, torch.bfloat16) for n in ("grpo_kl_k3_entropy", "stapo", "all_composed")
    ]
    for name, dtype in cases:
        cfg = LOSS_CASES[name]
        phase = lopti_phase_for(name, cfg)
        logits, targets, mask, old, ref, adv = make_inputs(seed=len(name), dtype=dtype)
        want, want_grad, *_ = naive_loss(logits, targets, mask, old, ref, adv, cfg, temperature=0.7, phase=phase)
        x = _shard(_pad(logits, PADDED), rank, world).clone().requires_grad_()
        inputs = LossInputs(targets=targets, old_logp=old, advantages=adv, mask=mask, ref_logp=ref, phase=phase)
        opts = VocabParallelOptions(temperature=0.7, tp_group=group, vocab_size=VOCAB, chunk_tokens=5, kernel=kernel)
        out, _ = fused_policy_loss(x, inputs, cfg, opts)
        (out.loss_sum / out.count.to(out.loss_sum.dtype)).backward()
        want_shard = _shard(torch.nn.functional.pad(want_grad, (0, PADDED - VOCAB)), rank, world)
        val_err = abs(float(out.loss_sum.detach() / out.count) - float(want))
        grad_err = float((x.grad.double() - want_shard).abs().max())
        grad_rel = float(((x.grad.double() - want_shard).abs() / (want_shard.abs() + 1e-5)).max())
        errs = torch.tensor([val_err, grad_err, grad_rel], dtype=torch.float64)
        dist.all_reduce(errs, op=dist.ReduceOp.MAX)
        report((f"logits/{name}/{dtype}", errs.tolist()))

    # a rank holding padding only: vocabulary 25 over 4 x 10 columns
    logits, targets, mask, old, ref, adv = make_inputs(seed=4, vocab=25)
    cfg = LOSS_CASES["grpo_kl_k3_entropy"]
    want, want_grad, want_lp, want_h, _ = naive_loss(logits, targets, mask, old, ref, adv, cfg, temperature=1.0)
    x = _shard(_pad(logits, PADDED), rank, world).clone().requires_grad_()
    opts = VocabParallelOptions(tp_group=group, vocab_size=25, chunk_tokens=4, token_grad_norms=True, kernel=kernel)
    out, stats = fused_policy_loss(x, LossInputs(targets=targets, old_logp=old, advantages=adv, mask=mask, ref_logp=ref), cfg, opts)
    (out.loss_sum / out.count.to(out.loss_sum.dtype)).backward()
    want_shard = _shard(torch.nn.functional.pad(want_grad, (0, PADDED - 25)), rank, world)
    # per-token norms of the loss-SUM gradient over the whole vocabulary (want_grad is of sum / count)
    want_norms = (want_grad * float(out.count)).reshape(-1, 25).norm(dim=-1)
    errs = torch.tensor([abs(float(out.loss_sum.detach() / out.count) - float(want)),
                         float((x.grad.double() - want_shard).abs().max()),
                         float((stats.logit_grad_norm.double() - want_norms).abs().max())], dtype=torch.float64)
    dist.all_reduce(errs, op=dist.ReduceOp.MAX)
    report(("logits/padding-only-rank", errs.tolist()))

    # forward-only log-probs and entropies
    lp, h = vocab_parallel_logprobs(_shard(_pad(logits, PADDED), rank, world), targets, mask=mask, options=opts)
    e = max(float((lp[mask].double() - want_lp[mask]).abs().max()), float((h[mask].double() - want_h[mask]).abs().max()))
    report(("forward_only", [e, 0.0, 0.0]))

    # fused-linear: hidden replicated, lm-head weight sharded by vocabulary rows
    for name in ("grpo_kl_k3_entropy", "all_composed"):
        cfg = LOSS_CASES[name]
        phase = lopti_phase_for(name, cfg)
        _, targets, mask, old, ref, adv = make_inputs(seed=11)
        g = torch.Generator().manual_seed(0)
        hidden = torch.randn(3, 7, 16, generator=g)
        weight = 0.5 * torch.randn(PADDED, 16, generator=g)
        full_h, full_w = hidden.double().requires_grad_(), weight.double().requires_grad_()
        lsm_logits = full_h @ full_w[:VOCAB].t()
        lp_full, ent_full = naive_logp_entropy(lsm_logits, targets, 0.9)
        ref_out = compute_policy_loss(lp_full, old, adv, mask, cfg, ref_logp=ref, entropy=ent_full, phase=phase)
        (ref_out.loss_sum / ref_out.count).backward()
        h = hidden.clone().requires_grad_()
        rows = slice(rank * (PADDED // world), (rank + 1) * (PADDED // world))
        w = weight[rows].clone().requires_grad_()
        inputs = LossInputs(targets=targets, old_logp=old, advantages=adv, mask=mask, ref_logp=ref, phase=phase)
        opts = VocabParallelOptions(temperature=0.9, tp_group=group, vocab_size=VOCAB, chunk_tokens=4, kernel=kernel)
        out, _ = fused_linear_policy_loss(h, w, inputs, cfg, opts)
        (out.loss_sum / out.count.to(out.loss_sum.dtype)).backward()
        errs = torch.tensor([
            abs(float(out.loss_sum.detach() / out.count) - float(ref_out.loss_sum.detach() / ref_out.count)),
            float((h.grad.double() - full_h.grad).abs().max()),
            float((w.grad.double() - full_w.grad[rows]).abs().max()),
        ], dtype=torch.float64)
        dist.all_reduce(errs, op=dist.ReduceOp.MAX)
        report((f"linear/{name}", errs.tolist()))


@pytest.mark.parametrize(
    "world,kernel",
    # Triton: its interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET=1, which the
    # spawned ranks inherit), so the kernels' TP path meets the same float64 reference.
    [(2, "torch"), (4, "torch"), pytest.param(2, "triton", marks=pytest.mark.skipif(
        importlib.util.find_spec("triton") is None, reason="Triton is not installed"))],
)
def test_fused_loss_tensor_parallel_matches_reference(world, kernel):
    results = run_on_ranks(_worker, world, kernel)
    assert len(results) == len(LOSS_CASES) + 3 + 2 + 2
    bad = []
    for name, (val, grad_abs, third) in results:
        if name.endswith("bfloat16"):
            ok = val < 1e-5 and (grad_abs < 1e-5 or third < 1.6e-2)
        elif name.startswith("linear") or name == "logits/padding-only-rank":
            ok = val < 1e-5 and grad_abs < 1e-5 and third < 1e-5
        else:
            ok = val < 1e-5 and grad_abs < 1e-5
        if not ok:
            bad.append((name, val, grad_abs, third))
    assert not bad, bad
