"""What ``compute_policy_loss`` reports besides the loss: the token selection it applied
(Lopti phase, STAPO's spurious set) and the effective advantages, checked against the
masks computed independently from their definitions; and ``broadcast_to_tokens``' dtype."""

import pytest
import torch

from megatron_rl.algo import (
    AdvantageConfig,
    AlgorithmConfig,
    ARConfig,
    LoptiConfig,
    STAPOConfig,
    broadcast_to_tokens,
    compute_advantages,
    compute_policy_loss,
    prepare_advantages,
)


def _tokens(seed=0, n=6, t=9):
    g = torch.Generator().manual_seed(seed)
    old = torch.log(torch.rand(n, t, generator=g, dtype=torch.float64).clamp(1e-4, 1))
    logp = (old + 0.05 * torch.randn(n, t, generator=g, dtype=torch.float64)).clamp(max=0)
    # some current probabilities below STAPO's tau_p = 0.002
    logp[:, ::4] = torch.log(torch.full((n, (t + 3) // 4), 1e-3, dtype=torch.float64))
    adv = broadcast_to_tokens(torch.randn(n, generator=g, dtype=torch.float64), torch.ones(n, t))
    mask = torch.rand(n, t, generator=g) < 0.8
    ent = torch.rand(n, t, generator=g, dtype=torch.float64) * 2
    return logp, old, adv, mask, ent


@pytest.mark.parametrize("phase", ["low", "high"])
@pytest.mark.parametrize("denominator", ["all", "phase"])
def test_lopti_phase_mask_and_effective_advantages(phase, denominator):
    logp, old, adv, mask, _ = _tokens()
    cfg = AlgorithmConfig(lopti=LoptiConfig(enabled=True, eta=0.5, denominator=denominator))
    out = compute_policy_loss(logp, old, adv, mask, cfg, phase=phase)
    low = mask & (old.exp() < 0.5)
    part = low if phase == "low" else mask & ~low
    assert torch.equal(out.masks["lopti/phase"], part) and set(out.masks) == {"lopti/phase"}
    assert torch.equal(out.active, part)
    assert torch.equal(out.counted, part if denominator == "phase" else mask)
    assert float(out.count) == float(out.counted.sum())
    assert torch.equal(out.advantages, torch.where(part, adv, torch.zeros_like(adv)))
    # the loss is the clipped objective of exactly these tokens with these advantages
    r = (logp - old).exp()
    a = out.advantages
    pg = torch.maximum(-a * r, -a * r.clamp(1 - cfg.eps_low, 1 + cfg.eps_high))
    pg = torch.where(a < 0, torch.minimum(pg, -a * cfg.dual_clip_c), pg)
    assert float(out.loss_sum) == pytest.approx(float(pg[out.active].sum()), rel=1e-12)


def test_stapo_spurious_set_is_reported():
    logp, old, adv, mask, ent = _tokens(1)
    cfg = AlgorithmConfig(stapo=STAPOConfig(enabled=True, tau_p=0.002, entropy_quantile=0.75))
    out = compute_policy_loss(logp, old, adv, mask, cfg, entropy=ent)
    cand = mask & (adv > 0) & (logp.exp() < 0.002)
    tau_h = torch.quantile(ent[cand], 0.75)  # numpy's linear interpolation, as the paper
    spurious = cand & (ent < tau_h)
    assert int(spurious.sum()) > 0 and torch.equal(out.masks["stapo/spurious"], spurious)
    assert torch.equal(out.active, mask & ~spurious) and torch.equal(out.counted, out.active)
    assert torch.equal(out.advantages, torch.where(out.active, adv, torch.zeros_like(adv)))


def test_plain_grpo_reports_all_valid_tokens_and_ar_advantages():
    logp, old, adv, mask, _ = _tokens(2)
    out = compute_policy_loss(logp, old, adv, mask, AlgorithmConfig())
    assert out.masks == {} and torch.equal(out.active, mask) and torch.equal(out.counted, mask)
    cfg = AlgorithmConfig(ar=ARConfig(alpha=0.3))
    weighted, _ = prepare_advantages(adv, old, mask, cfg)
    out = compute_policy_loss(logp, old, weighted, mask, cfg)
    want = torch.where(mask, adv * (0.3 * old.exp() + 0.7), torch.zeros_like(adv))
    assert torch.allclose(out.advantages, want, rtol=1e-12, atol=0)
    assert not out.advantages.requires_grad and not out.active.requires_grad


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_broadcast_keeps_the_advantages_dtype(dtype):
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25], dtype=torch.float64)
    adv = compute_advantages(rewards, torch.tensor([0, 0, 1, 1]), AdvantageConfig()).to(dtype)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1]])
    tokens = broadcast_to_tokens(adv, mask)
    assert tokens.dtype == dtype and tokens.shape == (4, 3)
    assert torch.equal(tokens, adv[:, None].expand(4, 3) * mask.to(dtype))
    # float64 end to end: no rounding through float32 on the way
    a64 = compute_advantages(torch.tensor([1.0, 0.0, 1e-9], dtype=torch.float64), torch.zeros(3), AdvantageConfig())
    assert torch.equal(broadcast_to_tokens(a64, torch.ones(3, 2))[:, 0], a64)
    # padding that holds NaN advantages cannot leak into masked positions
    assert broadcast_to_tokens(torch.tensor([float("nan")]), torch.zeros(1, 2)).eq(0).all()
