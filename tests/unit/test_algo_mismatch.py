"""Engine/actor log-prob mismatch metrics and TIS weights on hand-computed cases."""

import math

import pytest
import torch

from megatron_rl.algo.mismatch import logprob_mismatch


def test_metrics_hand_case():
    engine = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.0, -9.0]])
    actor = torch.tensor([[-1.1, -1.5, -0.5], [-3.0, -2.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    out = logprob_mismatch(engine, actor, mask)
    diffs = [-0.1, 0.5, 0.0, 0.0, -1.0]  # actor - engine over valid tokens (last one masked)
    m = out.metrics
    assert m["rollout/logp_mismatch/num_tokens"] == 5
    assert m["rollout/logp_mismatch/mean_abs"] == pytest.approx(sum(abs(d) for d in diffs) / 5)
    assert m["rollout/logp_mismatch/max_abs"] == pytest.approx(1.0)
    assert m["rollout/logp_mismatch/mean"] == pytest.approx(sum(diffs) / 5)
    assert m["rollout/logp_mismatch/ratio_mean"] == pytest.approx(sum(math.exp(d) for d in diffs) / 5)
    assert out.tis_weights is None


def test_tis_weights_hand_case():
    engine = torch.tensor([-2.0, -1.0, -1.0, -0.2, -5.0])
    actor = torch.tensor([-1.0, -1.0, -2.0, -0.2, 0.0])
    mask = torch.tensor([True, True, True, True, False])
    out = logprob_mismatch(engine, actor, mask, tis_cap=2.0)
    # ratios e^1 = 2.718 (capped to 2), 1, e^-1, 1; the masked token gets weight 1.
    expected = torch.tensor([2.0, 1.0, math.exp(-1.0), 1.0, 1.0])
    assert torch.allclose(out.tis_weights, expected)
    assert out.tis_weights.dtype == torch.float32
    assert out.metrics["rollout/tis/clip_frac"] == pytest.approx(0.25)
    assert out.metrics["rollout/tis/weight_mean"] == pytest.approx((2 + 1 + math.exp(-1) + 1) / 4)


def test_identical_logprobs_give_zero_mismatch_and_unit_weights():
    logp = -torch.rand(4, 7)
    out = logprob_mismatch(logp, logp.clone(), torch.ones(4, 7), tis_cap=3.0)
    assert out.metrics["rollout/logp_mismatch/max_abs"] == 0.0
    assert out.metrics["rollout/logp_mismatch/ratio_mean"] == pytest.approx(1.0)
    assert torch.equal(out.tis_weights, torch.ones(4, 7))


def test_no_valid_tokens_and_no_gradient():
    engine = torch.zeros(3, requires_grad=True)
    actor = torch.zeros(3, requires_grad=True)
    out = logprob_mismatch(engine, actor, torch.zeros(3, dtype=torch.bool), tis_cap=2.0)
    assert out.metrics["rollout/logp_mismatch/num_tokens"] == 0
    assert out.metrics["rollout/logp_mismatch/mean_abs"] == 0.0
    assert not out.tis_weights.requires_grad


def test_extreme_ratio_is_finite():
    out = logprob_mismatch(torch.tensor([-1000.0]), torch.tensor([0.0]), torch.tensor([1]), tis_cap=2.0)
    assert out.tis_weights.item() == 2.0
    assert math.isfinite(out.metrics["rollout/logp_mismatch/ratio_mean"])


def test_argument_errors():
    with pytest.raises(ValueError, match="shapes"):
        logprob_mismatch(torch.zeros(2), torch.zeros(3), torch.ones(2))
    with pytest.raises(ValueError, match="tis_cap"):
        logprob_mismatch(torch.zeros(2), torch.zeros(2), torch.ones(2), tis_cap=0.5)
