"""Policy loss: hand-computed cases, and values + gradients against an independent
float64 reference written below with Python scalars and hand-derived derivatives."""

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.algo import (
    AlgorithmConfig,
    ARConfig,
    LoptiConfig,
    STAPOConfig,
    TRGRPOConfig,
    compute_policy_loss,
    finalize_metrics,
    kl_penalty,
    merge_metrics,
    prepare_advantages,
)
from megatron_rl.algo.methods.stapo import STAPO_THRESHOLD_KEY
from tests.loss_cases import LOSS_CASES, lopti_phase_for

# ---------------------------------------------------------------- hand-computed cases


def one_token(logp, old, adv, cfg, **kw):
    lp = torch.tensor([logp], dtype=torch.float64, requires_grad=True)
    out = compute_policy_loss(
        lp, torch.tensor([old], dtype=torch.float64), torch.tensor([adv], dtype=torch.float64),
        torch.ones(1), cfg, **kw
    )
    out.loss_sum.backward()
    return float(out.loss_sum.detach()), float(lp.grad[0]), finalize_metrics(out.metrics)


@pytest.mark.parametrize(
    "ratio, adv, want_loss, want_grad, flag",
    [
        (1.0, 2.0, -2.0, -2.0, None),  # inside the clip range: -A r, d/dlogp = -A r
        (1.5, 1.0, -1.24, 0.0, "high"),  # A > 0 clipped at 1 + eps_high
        (0.5, 1.0, -0.5, -0.5, None),  # A > 0 below 1 - eps_low is NOT clipped (min picks r)
        (0.5, -1.0, 0.8, 0.0, "low"),  # A < 0 clipped at 1 - eps_low
        (1.5, -1.0, 1.5, 1.5, None),  # A < 0 above 1 + eps_high is not clipped
        (20.0, -1.0, 10.0, 0.0, "dual"),  # dual-clip caps at -A c
        (1.3, 0.0, 0.0, 0.0, None),
    ],
)
def test_ppo_clip_hand_computed(ratio, adv, want_loss, want_grad, flag):
    loss, grad, m = one_token(math.log(ratio) - 1.0, -1.0, adv, AlgorithmConfig())
    assert loss == pytest.approx(want_loss, abs=1e-12)
    assert grad == pytest.approx(want_grad, abs=1e-12)
    for name in ("low", "high", "dual"):
        assert m[f"loss/clip_frac/{name}"] == (1.0 if name == flag else 0.0)


def test_dual_clip_off():
    loss, grad, _ = one_token(math.log(20.0), 0.0, -1.0, AlgorithmConfig(dual_clip_c=None))
    assert loss == pytest.approx(20.0) and grad == pytest.approx(20.0)


def test_kl_estimators_hand_computed():
    lp = torch.tensor([-1.0, -1.0, -1.0], dtype=torch.float64)
    ref = torch.tensor([0.0, -9.0, 7.0], dtype=torch.float64)  # ref - logp = 1, -8 (clamp -5), 8 (clamp 5)
    assert kl_penalty(lp, ref, "k1").tolist() == pytest.approx([-1.0, 8.0, -8.0])
    assert kl_penalty(lp, ref, "k2").tolist() == pytest.approx([0.5, 32.0, 32.0])
    k3 = kl_penalty(lp, ref, "k3").tolist()
    assert k3 == pytest.approx([math.e - 2.0, math.exp(-5) + 5 - 1, 10.0])  # e^5 - 6 = 142.4 -> clamp 10


def test_kl_and_entropy_terms_hand_computed():
    cfg = AlgorithmConfig(kl_coef=0.5, kl_estimator="k1", entropy_coef=0.1)
    lp = torch.tensor([-1.0], dtype=torch.float64, requires_grad=True)
    ent = torch.tensor([2.0], dtype=torch.float64, requires_grad=True)
    out = compute_policy_loss(
        lp, torch.tensor([-1.0], dtype=torch.float64), torch.tensor([1.0], dtype=torch.float64),
        torch.ones(1), cfg, ref_logp=torch.tensor([-1.5], dtype=torch.float64), entropy=ent,
    )
    # -A r + 0.5 * (logp - ref) - 0.1 H = -1 + 0.25 - 0.2
    assert float(out.loss_sum.detach()) == pytest.approx(-0.95)
    out.loss_sum.backward()
    assert float(lp.grad) == pytest.approx(-1.0 + 0.5) and float(ent.grad) == pytest.approx(-0.1)


def test_aggregation_modes_hand_computed():
    # two sequences: per-token losses -A*r with r = 1 -> [-1, -3 | -2, pad]
    lp = torch.zeros(2, 2, dtype=torch.float64)
    adv = torch.tensor([[1.0, 3.0], [2.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 0]])

    def agg(**kw):
        out = compute_policy_loss(lp, lp, adv, mask, AlgorithmConfig(**kw))
        return float(out.loss_sum), float(out.count)

    assert agg() == (-6.0, 3.0)  # token mean -2
    s, n = agg(aggregation="seq_mean_token_mean")
    assert (s, n) == (pytest.approx(-2.0 + -2.0), 2.0)
    assert agg(aggregation="seq_mean_token_sum_norm", constant_normalizer=8) == (-6.0, 16.0)
    s, n = agg(aggregation="reference_microbatch_mean")
    assert (s, n) == (pytest.approx(-2.0), 1.0)


def test_packed_seq_index_equals_padded_rows():
    torch.manual_seed(0)
    lp, old, adv = torch.randn(3, 5).double(), torch.randn(3, 5).double(), torch.randn(3, 5).double()
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    cfg = AlgorithmConfig(aggregation="seq_mean_token_mean")
    padded = compute_policy_loss(lp, old, adv, mask, cfg)
    keep = mask.bool()
    seq = torch.arange(3).repeat_interleave(5).reshape(3, 5)[keep] * 17  # arbitrary, non-contiguous ids
    packed = compute_policy_loss(lp[keep], old[keep], adv[keep], mask[keep], cfg, seq_index=seq)
    assert float(packed.loss_sum) == pytest.approx(float(padded.loss_sum), rel=1e-14)
    assert float(packed.count) == float(padded.count) == 3.0


def test_padding_may_hold_nan_and_gets_zero_gradient():
    lp = torch.tensor([[-0.5, float("nan")]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-0.6, float("inf")]], dtype=torch.float64)
    adv = torch.tensor([[1.0, float("nan")]], dtype=torch.float64)
    cfg = AlgorithmConfig(kl_coef=0.1, entropy_coef=0.1, tr_grpo=TRGRPOConfig(enabled=True))
    out = compute_policy_loss(
        lp, old, adv, torch.tensor([[1, 0]]), cfg, ref_logp=old.clone(), entropy=torch.tensor([[1.0, float("nan")]])
    )
    out.loss_sum.backward()
    assert torch.isfinite(out.loss_sum) and torch.isfinite(lp.grad).all() and lp.grad[0, 1] == 0


def test_lopti_phase_required_and_phases_split_the_loss():
    torch.manual_seed(1)
    lp, old, adv = torch.randn(4, 6).double() - 1, torch.randn(4, 6).double() - 1, torch.randn(4, 6).double()
    mask = torch.ones(4, 6)
    base = AlgorithmConfig(kl_coef=0.01, ar=ARConfig(alpha=0.0))
    cfg = dataclasses.replace(base, lopti=LoptiConfig(enabled=True, eta=0.4))
    with pytest.raises(ValueError, match="lopti_phase"):
        compute_policy_loss(lp, old, adv, mask, cfg, ref_logp=old)
    with pytest.raises(ValueError, match="lopti.enabled is false"):
        compute_policy_loss(lp, old, adv, mask, base, ref_logp=old, phase="low")
    low = compute_policy_loss(lp, old, adv, mask, cfg, ref_logp=old, phase="low")
    high = compute_policy_loss(lp, old, adv, mask, cfg, ref_logp=old, phase="high")
    full = compute_policy_loss(lp, old, adv, mask, base, ref_logp=old)
    # denominator "all": both passes count every valid token, and their sums add up to GRPO's
    assert float(low.count) == float(high.count) == float(full.count) == 24.0
    assert float(low.loss_sum + high.loss_sum) == pytest.approx(float(full.loss_sum), rel=1e-12)
    n_low = int((old.exp() < 0.4).sum())
    phase_cfg = dataclasses.replace(cfg, lopti=LoptiConfig(enabled=True, eta=0.4, denominator="phase"))
    assert float(compute_policy_loss(lp, old, adv, mask, phase_cfg, ref_logp=old, phase="low").count) == n_low
    assert finalize_metrics(low.metrics)["loss/lopti/low_frac"] == pytest.approx(n_low / 24)


def test_missing_inputs_are_named():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="ref_logp"):
        compute_policy_loss(x, x, x, x + 1, AlgorithmConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="entropy"):
        compute_policy_loss(x, x, x, x + 1, AlgorithmConfig(stapo=STAPOConfig(enabled=True)))
    with pytest.raises(ValueError, match="share one shape"):
        compute_policy_loss(x, torch.zeros(4), x, x, AlgorithmConfig())


def test_metrics_merge_by_summing():
    a = {"m": torch.tensor([1.0, 2.0], dtype=torch.float64)}
    b = {"m": torch.tensor([3.0, 2.0], dtype=torch.float64), "n": torch.tensor([0.0, 0.0], dtype=torch.float64)}
    merged = merge_metrics([a, b])
    assert merged["m"].tolist() == [4.0, 4.0]
    assert finalize_metrics(merged) == {"m": 1.0}  # "n" has no tokens: left out, not 0


# ---------------------------------------------------------------- independent reference


def _sig(x):
    return 1.0 / (1.0 + math.exp(-x))


def _quantile(vals, q):
    v = sorted(vals)
    pos = q * (len(v) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def reference(lp, old, adv, mask, cfg, ref=None, ent=None, phase=None):
    """Loss (sum / count) and d/dlogp, d/dH as nested lists; rows are sequences."""
    rows, cols = len(lp), len(lp[0])
    cells = [(i, t) for i in range(rows) for t in range(cols) if mask[i][t]]
    active = set(cells)
    counted = set(cells)
    if cfg.lopti.enabled:
        low = {c for c in cells if math.exp(old[c[0]][c[1]]) < cfg.lopti.eta}
        active = low if phase == "low" else active - low
        if cfg.lopti.denominator == "phase":
            counted = set(active)
    if cfg.stapo.enabled:
        cand = [c for c in active if adv[c[0]][c[1]] > 0 and math.exp(lp[c[0]][c[1]]) < cfg.stapo.tau_p]
        if cand:
            tau_h = _quantile([ent[i][t] for i, t in cand], cfg.stapo.entropy_quantile)
            spurious = {c for c in cand if ent[c[0]][c[1]] < tau_h}
            active -= spurious
            counted -= spurious
    tr = cfg.tr_grpo
    # aggregation coefficients
    if cfg.aggregation == "token_mean":
        coef = {c: 1.0 for c in active}
        count = len(counted)
    elif cfg.aggregation == "reference_microbatch_mean":
        coef = {c: 1.0 / max(len(counted), 1) for c in active}
        count = 1
    elif cfg.aggregation == "seq_mean_token_mean":
        per = {}
        for i, _ in counted:
            per[i] = per.get(i, 0) + 1
        coef = {c: 1.0 / per[c[0]] for c in active}
        count = len(per)
    else:
        count = len({i for i, _ in cells}) * cfg.constant_normalizer
        coef = {c: 1.0 for c in active}
    total = 0.0
    g_lp = [[0.0] * cols for _ in range(rows)]
    g_h = [[0.0] * cols for _ in range(rows)]
    for c in active:
        i, t = c
        a = adv[i][t]
        r = math.exp(lp[i][t] - old[i][t])
        w = 1.0
        if tr.enabled:
            w = min(max(tr.resolved_alpha() * (_sig(math.exp(lp[i][t]) / tr.tau) - tr.mu), tr.lower), tr.upper)
        x = w * r if (tr.enabled and tr.placement == "ratio") else r
        lo, hi = 1 - cfg.eps_low, 1 + cfg.eps_high
        if a > 0:
            pg, dpg = (-a * x, -a * x) if x <= hi else (-a * hi, 0.0)
        elif a < 0:
            pg, dpg = (-a * x, -a * x) if x >= lo else (-a * lo, 0.0)
            if cfg.dual_clip_c is not None and pg > -a * cfg.dual_clip_c:
                pg, dpg = -a * cfg.dual_clip_c, 0.0
        else:
            pg, dpg = 0.0, 0.0
        kl = dkl = 0.0
        if cfg.kl_coef > 0:
            d = ref[i][t] - lp[i][t]
            if cfg.kl_estimator == "k1":
                kl, dkl = -d, 1.0
            elif cfg.kl_estimator == "k2":
                kl, dkl = 0.5 * d * d, -d
            else:
                k = min(max(d, -5.0), 5.0)
                kl = math.exp(k) - k - 1
                dkl = -(math.exp(k) - 1) if -5 < d < 5 else 0.0
                if kl > 10:
                    kl, dkl = 10.0, 0.0
        if tr.enabled and tr.placement == "loss":
            l, dl = w * (pg + cfg.kl_coef * kl), w * (dpg + cfg.kl_coef * dkl)
        else:
            l, dl = pg + cfg.kl_coef * w * kl, dpg + cfg.kl_coef * w * dkl
        l -= cfg.entropy_coef * (ent[i][t] if ent is not None else 0.0)
        total += coef[c] * l
        g_lp[i][t] = coef[c] * dl / count
        g_h[i][t] = -coef[c] * cfg.entropy_coef / count
    return total / count, g_lp, g_h


CONFIGS = LOSS_CASES


def random_batch(seed, rows=5, cols=9):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(rows, cols, generator=g, dtype=torch.float64) * 4  # p in [0.018, 1]
    old = lp + 0.4 * torch.randn(rows, cols, generator=g, dtype=torch.float64)  # ratios ~ [0.3, 3]
    ref = lp + 0.8 * torch.randn(rows, cols, generator=g, dtype=torch.float64)
    adv = torch.randn(rows, 1, generator=g, dtype=torch.float64).expand(rows, cols).clone()
    adv[0] = 0.0
    ent = torch.rand(rows, cols, generator=g, dtype=torch.float64) * 3
    lengths = torch.randint(1, cols + 1, (rows,), generator=g)
    mask = (torch.arange(cols)[None, :] < lengths[:, None]).long()
    return lp, old, ref, adv, ent, mask


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_independent_float64_reference(name, dtype, seed):
    cfg = CONFIGS[name]
    lp, old, ref, adv, ent, mask = random_batch(seed)
    phase = lopti_phase_for(name, cfg)
    want, want_glp, want_gh = reference(
        lp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), cfg, ref.tolist(), ent.tolist(), phase
    )
    lp_t = lp.to(dtype).requires_grad_()
    ent_t = ent.to(dtype).requires_grad_()
    out = compute_policy_loss(
        lp_t, old.to(dtype), adv.to(dtype), mask, cfg, ref_logp=ref.to(dtype), entropy=ent_t, phase=phase
    )
    loss = out.loss_sum / out.count.to(dtype)
    loss.backward()
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert float(loss.detach()) == pytest.approx(want, abs=tol, rel=tol)
    torch.testing.assert_close(lp_t.grad.double(), torch.tensor(want_glp, dtype=torch.float64), atol=tol, rtol=tol)
    g_ent = ent_t.grad if ent_t.grad is not None else torch.zeros_like(ent_t)
    torch.testing.assert_close(g_ent.double(), torch.tensor(want_gh, dtype=torch.float64), atol=tol, rtol=tol)


def test_reference_exercises_every_clip_branch():
    """Guard: the random batches above actually hit low, high and dual clipping."""
    seen = {"low": 0.0, "high": 0.0}
    for seed in range(3):
        lp, old, _, adv, _, mask = random_batch(seed)
        m = finalize_metrics(compute_policy_loss(lp, old, adv, mask, AlgorithmConfig()).metrics)
        for k in seen:
            seen[k] += m[f"loss/clip_frac/{k}"]
    assert all(v > 0 for v in seen.values())
    lp, old, _, adv, _, mask = random_batch(0)
    m = finalize_metrics(compute_policy_loss(lp, old, adv * 0 - 1, mask, AlgorithmConfig(dual_clip_c=1.5)).metrics)
    assert m["loss/clip_frac/dual"] > 0


# ---------------------------------------------------------------- properties


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from(["grpo", "seq_mean", "tr_ratio", "stapo", "lopti_low"]))
def test_ar_alpha_zero_equals_grpo_exactly(seed, name):
    cfg = CONFIGS[name]
    lp, old, ref, adv, ent, mask = random_batch(seed)
    phase = "low" if cfg.lopti.enabled else None
    adv0, metrics = prepare_advantages(adv, old, mask, dataclasses.replace(cfg, ar=ARConfig(alpha=0.0)))
    assert metrics == {}
    grads = []
    for a in (adv, adv0):
        x = lp.clone().requires_grad_()
        out = compute_policy_loss(x, old, a, mask, cfg, ref_logp=ref, entropy=ent, phase=phase)
        out.loss_sum.backward()
        grads.append((out.loss_sum.detach(), x.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_ar_scales_advantages_by_old_probability():
    lp, old, _, adv, _, mask = random_batch(3)
    cfg = AlgorithmConfig(ar=ARConfig(alpha=0.3))
    got, metrics = prepare_advantages(adv, old, mask, cfg)
    want = torch.where(mask.bool(), adv * (0.3 * old.exp() + 0.7), adv)
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], rtol=0, atol=1e-15)
    w = (0.3 * old.exp() + 0.7)[mask.bool()]
    assert finalize_metrics(metrics)["loss/ar/weight_mean"] == pytest.approx(float(w.mean()))


def test_stapo_renormalises_over_kept_tokens_and_uses_given_threshold():
    lp, old, _, adv, ent, mask = random_batch(4)
    cfg = CONFIGS["stapo"]
    out_local = compute_policy_loss(lp, old, adv, mask, cfg, entropy=ent)
    masked = finalize_metrics(out_local.metrics)["loss/stapo/masked_frac"]
    assert masked > 0
    assert float(out_local.count) == pytest.approx(float(mask.sum()) * (1 - masked))
    # a threshold below every entropy masks nothing
    out_none = compute_policy_loss(lp, old, adv, mask, cfg, entropy=ent, prepass={STAPO_THRESHOLD_KEY: -1.0})
    assert finalize_metrics(out_none.metrics)["loss/stapo/masked_frac"] == 0.0
    assert float(out_none.count) == float(mask.sum())
