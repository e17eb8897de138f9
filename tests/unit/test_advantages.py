"""Advantage estimators: hand-computed cases, groups of one, registry behaviour."""

import math

import pytest
import torch

from megatron_rl.algo import (
    AdvantageConfig,
    UnknownEstimatorError,
    broadcast_to_tokens,
    compute_advantages,
    get_advantage_estimator,
    register_advantage,
    registered_advantages,
)
from megatron_rl.algo import advantages as adv_mod

EPS = 1e-6


def adv(name, rewards, groups, **kw):
    cfg = AdvantageConfig(estimator=name, **kw)
    return compute_advantages(
        torch.tensor(rewards, dtype=torch.float64), torch.tensor(groups), cfg
    ).tolist()


def test_grpo_hand_computed_unbiased_std():
    # mean 0.75; unbiased var = (3 * 0.25^2 + 0.75^2) / 3 = 0.25 -> std 0.5
    got = adv("grpo", [1.0, 0.0, 1.0, 1.0], [7, 7, 7, 7])
    want = [0.25 / (0.5 + EPS), -0.75 / (0.5 + EPS), 0.25 / (0.5 + EPS), 0.25 / (0.5 + EPS)]
    assert got == pytest.approx(want, rel=1e-12, abs=0)


def test_grpo_groups_are_independent_and_ids_need_not_be_contiguous():
    got = adv("grpo", [3.0, -3.0, 0.0, 2.0, 4.0], [10, 10, 3, 3, 3])
    s1 = math.sqrt(((3.0) ** 2 + (-3.0) ** 2) / 1)  # mean 0, unbiased
    s2 = math.sqrt((4.0 + 0.0 + 4.0) / 2)
    want = [3.0 / (s1 + EPS), -3.0 / (s1 + EPS), -2.0 / (s2 + EPS), 0.0, 2.0 / (s2 + EPS)]
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)


def test_grpo_equal_rewards_give_zero():
    assert adv("grpo", [-0.5, -0.5, -0.5], [0, 0, 0]) == [0.0, 0.0, 0.0]


def test_group_of_one_is_zero_by_default_and_raw_reward_on_request():
    for name in ("grpo", "dr_grpo", "rloo"):
        assert adv(name, [3.0, 1.0, 2.0], [0, 1, 1])[0] == 0.0
    assert adv("grpo", [3.0], [0], single_sample_group="raw_reward") == pytest.approx([3.0 / (1 + EPS)])


def test_dr_grpo_drops_std():
    assert adv("dr_grpo", [1.0, 0.0, 1.0, 1.0], [0, 0, 0, 0]) == pytest.approx([0.25, -0.75, 0.25, 0.25])


def test_rloo_leave_one_out():
    # R_i - mean of the others
    got = adv("rloo", [1.0, 0.0, 1.0, 1.0], [0, 0, 0, 0])
    assert got == pytest.approx([1 - 2 / 3, 0 - 1, 1 - 2 / 3, 1 - 2 / 3], rel=1e-12)


def test_reinforce_pp_whitens_over_the_batch_ignoring_groups():
    r = [1.0, 2.0, 3.0, 6.0]
    mean = 3.0
    std = math.sqrt(((4 + 1 + 0 + 9) / 3))
    want = [(x - mean) / (std + EPS) for x in r]
    assert adv("reinforce_pp", r, [0, 0, 1, 1]) == pytest.approx(want, rel=1e-12)
    assert adv("reinforce_pp", r, [0, 1, 2, 3]) == pytest.approx(want, rel=1e-12)


def test_dtype_preserved_and_computed_in_float64():
    r = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float32)
    a = compute_advantages(r, torch.zeros(4, dtype=torch.long), AdvantageConfig())
    assert a.dtype == torch.float32


def test_broadcast_to_tokens_zero_on_padding():
    a = broadcast_to_tokens(torch.tensor([2.0, -1.0]), torch.tensor([[1, 1, 0], [1, 0, 0]]))
    assert a.tolist() == [[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]]


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="non-finite rewards at response indices \\[1\\]"):
        compute_advantages(torch.tensor([0.0, float("nan")]), torch.tensor([0, 0]), AdvantageConfig())
    with pytest.raises(ValueError, match="must both be \\[N\\]"):
        compute_advantages(torch.zeros(3), torch.zeros(2), AdvantageConfig())


def test_registry_refuses_duplicates_and_lists_names():
    assert {"grpo", "dr_grpo", "rloo", "reinforce_pp"} <= set(registered_advantages())
    with pytest.raises(ValueError, match="already registered"):
        register_advantage("grpo")(lambda r, g, c: r)
    with pytest.raises(UnknownEstimatorError) as err:
        get_advantage_estimator("gpro")
    msg = str(err.value)
    assert "'gpro'" in msg and "grpo" in msg and "rloo" in msg and "reinforce_pp" in msg


def test_user_estimator_is_a_peer_of_the_builtins():
    name = "test_only_constant"
    try:
        @register_advantage(name)
        def _const(rewards_N, group_index_N, config):
            return torch.full_like(rewards_N, 0.5)

        assert adv(name, [1.0, 2.0], [0, 0]) == [0.5, 0.5]
    finally:
        adv_mod.ADVANTAGE_ESTIMATORS.unregister(name)
