"""Token-weight methods as registered objects: generic phases, pre-pass statistics, and a
user method composed by the policy loss like the built-ins."""

import dataclasses

import pytest
import torch

from megatron_rl.algo import (
    TOKEN_WEIGHT_METHODS,
    AlgorithmConfig,
    LoptiConfig,
    PrepassTokens,
    STAPOConfig,
    TokenWeightMethod,
    compute_policy_loss,
    lopti_split,
    needs_prepass,
    prepass_statistics,
    stapo_candidates,
    stapo_entropy_threshold,
    update_phases,
)
from megatron_rl.algo.methods.stapo import STAPO_THRESHOLD_KEY


def _tokens(seed=0, shape=(4, 9)):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(shape, generator=g, dtype=torch.float64) * 4
    old = logp + 0.1 * torch.randn(shape, generator=g, dtype=torch.float64)
    adv = torch.randn(shape[0], 1, generator=g, dtype=torch.float64).expand(shape).clone()
    ent = torch.rand(shape, generator=g, dtype=torch.float64) * 3
    mask = torch.ones(shape, dtype=torch.bool)
    mask[:, 0] = False
    return logp, old, adv, ent, mask


def test_builtin_methods_are_registered_in_composition_order():
    assert [name for name, _ in TOKEN_WEIGHT_METHODS.items()][:4] == ["ar", "lopti", "stapo", "tr_grpo"]


def test_phases_and_prepass_come_from_the_enabled_methods():
    assert update_phases(AlgorithmConfig()) == (None,)
    assert update_phases(AlgorithmConfig(lopti=LoptiConfig(enabled=True))) == ("low", "high")
    assert not needs_prepass(AlgorithmConfig()) and not needs_prepass(AlgorithmConfig(lopti=LoptiConfig(enabled=True)))
    assert needs_prepass(AlgorithmConfig(stapo=STAPOConfig(enabled=True)))


def test_prepass_statistics_equal_the_threshold_over_the_phase_candidates():
    cfg = AlgorithmConfig(lopti=LoptiConfig(enabled=True, eta=0.3), stapo=STAPOConfig(enabled=True, tau_p=0.2))
    logp, old, adv, ent, mask = _tokens()
    parts = [PrepassTokens(logp=logp[:2], entropy=ent[:2], old_logp=old[:2], advantages=adv[:2], mask=mask[:2]),
             PrepassTokens(logp=logp[2:], entropy=ent[2:], old_logp=old[2:], advantages=adv[2:], mask=mask[2:])]  # fmt: skip
    stats = prepass_statistics(cfg, "high", parts)
    _, high = lopti_split(old, mask, 0.3)
    cand = stapo_candidates(adv, logp, high, 0.2)
    expected = stapo_entropy_threshold(ent, cand, cfg.stapo.entropy_quantile)
    assert float(stats[STAPO_THRESHOLD_KEY]) == float(expected)
    # The loss given the statistic equals the loss computing it over the same (whole) batch.
    given = compute_policy_loss(logp, old, adv, mask, cfg, entropy=ent, phase="high", prepass=stats)
    local = compute_policy_loss(logp, old, adv, mask, cfg, entropy=ent, phase="high")
    assert float(given.loss_sum) == float(local.loss_sum) and float(given.count) == float(local.count)


def test_phase_errors_name_the_method_switch():
    with pytest.raises(ValueError, match="algorithm.lopti.enabled is false"):
        compute_policy_loss(*_tokens()[:3], _tokens()[4], AlgorithmConfig(), phase="low")
    with pytest.raises(ValueError, match=r"algorithm.lopti is enabled: every update runs in one of its phases"):
        compute_policy_loss(*_tokens()[:3], _tokens()[4], AlgorithmConfig(lopti=LoptiConfig(enabled=True)))


class _DropSecondColumn(TokenWeightMethod):
    """A user method: silences column 1 (from the numerator and the normaliser)."""

    name = "test_drop_second_column"

    def enabled(self, config):
        return config.kl_estimator == "k2"  # any switch of the user's choosing

    def select(self, tokens, config, phase, prepass):
        keep = torch.ones_like(tokens.valid)
        keep[..., 1] = False
        tokens.active = tokens.active & keep
        tokens.counted = tokens.counted & keep


class _PhasedToo(TokenWeightMethod):
    name = "test_phased_too"

    def enabled(self, config):
        return True

    def phases(self, config):
        return ("a", "b")


def test_a_registered_user_method_composes_like_the_builtins():
    logp, old, adv, _, mask = _tokens(1)
    cfg = dataclasses.replace(AlgorithmConfig(), kl_estimator="k2")
    TOKEN_WEIGHT_METHODS.register(_DropSecondColumn.name, _DropSecondColumn())
    try:
        with_method = compute_policy_loss(logp, old, adv, mask, cfg)
    finally:
        TOKEN_WEIGHT_METHODS.unregister(_DropSecondColumn.name)
    masked = mask.clone()
    masked[:, 1] = False
    by_hand = compute_policy_loss(logp, old, adv, masked, cfg)
    assert float(with_method.loss_sum) == float(by_hand.loss_sum)
    assert float(with_method.count) == float(by_hand.count) == float(masked.sum())


def test_two_phased_methods_are_refused():
    TOKEN_WEIGHT_METHODS.register(_PhasedToo.name, _PhasedToo())
    try:
        assert update_phases(AlgorithmConfig()) == ("a", "b")
        with pytest.raises(ValueError, match="at most one enabled method"):
            update_phases(AlgorithmConfig(lopti=LoptiConfig(enabled=True)))
    finally:
        TOKEN_WEIGHT_METHODS.unregister(_PhasedToo.name)


def test_each_builtin_method_is_one_file_with_its_section():
    """A method's config class, its hook object and its math live in one module, and the
    ``algorithm`` section holds its config under the method's name."""
    import sys
    import typing

    hints = typing.get_type_hints(AlgorithmConfig)
    for name in ("ar", "lopti", "stapo", "tr_grpo"):
        method = TOKEN_WEIGHT_METHODS.get(name)
        module = type(method).__module__
        assert module == f"megatron_rl.algo.methods.{name}"
        assert method.config_class.__module__ == module and hints[name] is method.config_class
        assert isinstance(getattr(AlgorithmConfig(), name), method.config_class)
        assert sys.modules[module].__doc__.count("arXiv") == 1  # the file names its paper
