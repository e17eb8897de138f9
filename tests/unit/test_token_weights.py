"""Token weights and masks: hand-computed cases and property tests."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.algo import (
    TRGRPOConfig,
    advantage_reweight,
    lopti_split,
    stapo_candidates,
    stapo_entropy_threshold,
    stapo_spurious_mask,
    tr_grpo_weight,
)

floats01 = st.floats(min_value=1e-6, max_value=1.0, allow_nan=False)


def logp_of(ps):
    return torch.log(torch.tensor(ps, dtype=torch.float64))


def test_ar_hand_computed():
    adv = torch.tensor([2.0, -1.0, 3.0], dtype=torch.float64)
    old = logp_of([0.5, 0.1, 0.9])
    mask = torch.tensor([1, 1, 0])
    out, w = advantage_reweight(adv, old, mask, alpha=0.3)
    # w = 0.3 p + 0.7 on valid tokens, 0 on padding
    assert w.tolist() == pytest.approx([0.85, 0.73, 0.0])
    assert out.tolist() == pytest.approx([1.7, -0.73, 0.0])


def test_ar_alpha_zero_is_identity_bitwise():
    adv = torch.randn(5, 7)
    out, _ = advantage_reweight(adv, torch.randn(5, 7), torch.ones(5, 7), alpha=0.0)
    assert torch.equal(out, adv)


@settings(max_examples=60, deadline=None)
@given(st.lists(floats01, min_size=1, max_size=30), st.floats(0.0, 1.0))
def test_ar_weights_lie_in_one_minus_alpha_to_one(ps, alpha):
    _, w = advantage_reweight(torch.ones(len(ps), dtype=torch.float64), logp_of(ps), torch.ones(len(ps)), alpha)
    assert (w >= 1 - alpha - 1e-12).all() and (w <= 1 + 1e-12).all()


def test_lopti_split_is_strict_at_eta():
    low, high = lopti_split(logp_of([0.5, 0.49, 0.51, 0.2]), torch.tensor([1, 1, 1, 0]), eta=0.5)
    assert low.tolist() == [False, True, False, False]
    assert high.tolist() == [True, False, True, False]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(floats01, st.booleans()), min_size=1, max_size=40), st.floats(0.01, 0.99))
def test_lopti_phases_partition_the_valid_tokens(rows, eta):
    ps, valid = zip(*rows)
    mask = torch.tensor(valid)
    old_logp = logp_of(list(ps))
    low, high = lopti_split(old_logp, mask, eta)
    assert not (low & high).any()
    assert torch.equal(low | high, mask)
    # p_old is what the log-prob represents: exp(log p) may differ from p in the last bit,
    # and libm's exp from torch's (the split's) too, so it is torch's exp of the same float64
    p_old = torch.exp(old_logp).tolist()
    assert all((p < eta) == bool(lo) for p, lo, v in zip(p_old, low.tolist(), valid) if v)


def test_tr_weight_hand_computed_and_default_alpha():
    cfg = TRGRPOConfig(enabled=True, tau=1.0, mu=0.5, lower=0.0, upper=10.0)
    alpha = 1.0 / (1.0 / (1.0 + math.exp(-1.0)) - 0.5)
    assert cfg.resolved_alpha() == pytest.approx(alpha)
    w = tr_grpo_weight(logp_of([1.0, 0.5, 1e-9]), cfg)
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    assert w.tolist() == pytest.approx([1.0, alpha * (sig(0.5) - 0.5), alpha * (sig(1e-9) - 0.5)])
    cfg2 = TRGRPOConfig(enabled=True, alpha=2.0, tau=0.5, mu=0.6, lower=0.2, upper=0.8)
    w2 = tr_grpo_weight(logp_of([1.0, 0.3, 0.01]), cfg2)
    raw = [2.0 * (sig(p / 0.5) - 0.6) for p in (1.0, 0.3, 0.01)]
    assert w2.tolist() == pytest.approx([min(max(x, 0.2), 0.8) for x in raw])


def test_tr_weight_has_no_gradient():
    lp = logp_of([0.3, 0.6]).requires_grad_()
    assert not tr_grpo_weight(lp, TRGRPOConfig(enabled=True)).requires_grad


@settings(max_examples=60, deadline=None)
@given(
    st.lists(floats01, min_size=2, max_size=30),
    st.floats(0.05, 5.0),
    st.floats(-1.0, 0.5),
    st.floats(0.0, 0.5),
    st.floats(0.5, 3.0),
)
def test_tr_weights_monotone_in_p_and_within_bounds(ps, tau, mu, lower, upper):
    cfg = TRGRPOConfig(enabled=True, alpha=1.7, tau=tau, mu=mu, lower=lower, upper=upper)
    ps = sorted(ps)
    w = tr_grpo_weight(logp_of(ps), cfg)
    assert (w >= lower).all() and (w <= upper).all()
    assert (w[1:] >= w[:-1]).all()


def test_stapo_hand_computed():
    adv = torch.tensor([1.0, 1.0, 1.0, 1.0, -1.0, 1.0, 1.0])
    ps = [0.001, 0.001, 0.001, 0.001, 0.001, 0.5, 0.002]  # last: p == tau_p, not a candidate
    mask = torch.tensor([1, 1, 1, 1, 1, 1, 1])
    ent = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0, 0.0, 0.0])
    cand = stapo_candidates(adv, logp_of(ps), mask, tau_p=0.002)
    assert cand.tolist() == [True, True, True, True, False, False, False]
    tau_h = stapo_entropy_threshold(ent, cand, 0.75)
    # numpy-style linear quantile of [0.1, 0.2, 0.3, 0.4] at 0.75: position 2.25 -> 0.325
    assert float(tau_h) == pytest.approx(0.325)
    assert stapo_spurious_mask(cand, ent, tau_h).tolist() == [True, True, True, False, False, False, False]
    # strict H < tau_h: a token exactly at the threshold is kept
    assert not stapo_spurious_mask(cand, ent, 0.1)[0]


def test_stapo_no_candidates_masks_nothing():
    cand = torch.zeros(4, dtype=torch.bool)
    tau_h = stapo_entropy_threshold(torch.rand(4), cand, 0.75)
    assert tau_h == float("-inf")
    assert not stapo_spurious_mask(cand, torch.rand(4), tau_h).any()


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.tuples(st.floats(-3, 3), floats01, st.floats(0, 5), st.booleans()), min_size=1, max_size=40),
    st.floats(0.0, 1.0),
)
def test_stapo_never_masks_nonpositive_advantage(rows, q):
    a, p, h, v = map(list, zip(*rows))
    adv, ent, mask = torch.tensor(a), torch.tensor(h), torch.tensor(v)
    cand = stapo_candidates(adv, logp_of(p), mask, tau_p=0.5)
    spurious = stapo_spurious_mask(cand, ent, stapo_entropy_threshold(ent, cand, q))
    assert not (spurious & (adv <= 0)).any()
    assert not (spurious & ~mask).any()
