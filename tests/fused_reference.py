"""Inputs and the naive float64 reference for the fused-loss tests.

The reference gathers the full logits, takes ``log_softmax`` and the entropy in float64
and runs the ``algo/`` loss on them with plain autograd: everything the fused op avoids.
"""

import torch

from megatron_rl.algo import compute_policy_loss


def make_inputs(seed=0, rows=3, cols=7, vocab=37, dtype=torch.float32, scale=2.0):
    """Logits ``[rows, cols, vocab]`` and the per-token loss inputs, with padding."""
    g = torch.Generator().manual_seed(seed)
    logits = (scale * torch.randn(rows, cols, vocab, generator=g, dtype=torch.float64)).to(dtype)
    targets = torch.randint(0, vocab, (rows, cols), generator=g)
    lengths = torch.randint(1, cols + 1, (rows,), generator=g)
    lengths[0] = cols
    mask = torch.arange(cols)[None] < lengths[:, None]
    targets = torch.where(mask, targets, torch.full_like(targets, -100))
    with torch.no_grad():
        noise = 0.5 * torch.randn(rows, cols, vocab, generator=g, dtype=torch.float64)
        old_logp, _ = naive_logp_entropy(logits.double() + noise, targets, 1.0)
        ref_logp, _ = naive_logp_entropy(logits.double() - noise, targets, 1.0)
    adv = torch.randn(rows, 1, generator=g, dtype=torch.float64).expand(rows, cols).clone()
    adv = torch.where(mask, adv, torch.zeros_like(adv))
    return logits, targets, mask, old_logp, ref_logp, adv


def make_linear_inputs(seed, weight_seed):
    """float64 hidden states ``[3, 7, 16]``, an lm-head ``[37, 16]`` (generator ``weight_seed``)
    and :func:`make_inputs`' loss inputs at ``seed`` as ``LossInputs``; also returns those
    inputs' tensors ``(targets, mask, old_logp, ref_logp, adv)`` for the naive reference."""
    from megatron_rl.ops import LossInputs

    _, targets, mask, old, ref, adv = make_inputs(seed=seed)
    g = torch.Generator().manual_seed(weight_seed)
    hidden = torch.randn(3, 7, 16, generator=g, dtype=torch.float64)
    weight = 0.5 * torch.randn(37, 16, generator=g, dtype=torch.float64)
    inputs = LossInputs(targets=targets, old_logp=old, advantages=adv, mask=mask, ref_logp=ref)
    return hidden, weight, inputs, (targets, mask, old, ref, adv)


def naive_logp_entropy(logits, targets, temperature):
    lsm = torch.log_softmax(logits.double() / temperature, dim=-1)
    logp = lsm.gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
    entropy = -(lsm.exp() * lsm).sum(-1)
    return logp, entropy


def naive_loss(logits, targets, mask, old_logp, ref_logp, adv, cfg, *, temperature, phase=None, vocab_size=None):
    """``(loss, d loss / d logits, logp, entropy, metrics)`` in float64 with ``loss = sum / count``."""
    full = logits.detach().double().clone().requires_grad_()
    used = full if vocab_size is None else full[..., :vocab_size]
    logp, entropy = naive_logp_entropy(used, targets, temperature)
    out = compute_policy_loss(
        logp, old_logp, adv, mask, cfg, ref_logp=ref_logp, entropy=entropy, phase=phase
    )
    loss = out.loss_sum / out.count
    loss.backward()
    return loss.detach(), full.grad, logp.detach(), entropy.detach(), out.metrics
