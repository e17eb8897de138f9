"""Sampling primitives: hand cases for temperature / top-k / top-p, seeds, SamplingParams."""

import math

import pytest
import torch

from megatron_rl.config.seeding import derive_seed, prompt_seeds_for
from megatron_rl.rollout.engines.sampling import row_seeds, sample_next, sample_uniforms, truncated_probs
from megatron_rl.rollout.generation import SamplingParams

# Four tokens with probabilities 0.5, 0.3, 0.15, 0.05 at T = 1 (CDF 0.5, 0.8, 0.95, 1.0).
PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log()[None]


def _sample(uniforms, **params):
    u = torch.tensor(uniforms, dtype=torch.float64)
    tokens, logp = sample_next(LOGITS.expand(len(uniforms), -1), u, SamplingParams(**params))
    return tokens.tolist(), logp


def test_inverse_cdf_without_truncation():
    # u * total falls in [0, .5) -> 0, [.5, .8) -> 1, [.8, .95) -> 2, [.95, 1) -> 3.
    tokens, logp = _sample([0.0, 0.49, 0.55, 0.79, 0.81, 0.94, 0.96, 0.999])
    assert tokens == [0, 0, 1, 1, 2, 2, 3, 3]
    assert torch.allclose(logp, PROBS.log()[tokens], atol=1e-6)


def test_top_k_keeps_k_tokens_and_reports_full_logprob():
    # top-k = 2 renormalises {0.5, 0.3}: u < 0.625 -> 0, else 1.
    tokens, logp = _sample([0.0, 0.6, 0.63, 0.99], top_k=2)
    assert tokens == [0, 0, 1, 1]
    # The log-prob is of the FULL distribution (0.3, not 0.3 / 0.8): the trainer's quantity.
    assert logp[-1].item() == pytest.approx(math.log(0.3), abs=1e-6)
    assert _sample([0.0, 0.5, 0.999], top_k=1)[0] == [0, 0, 0]


def test_top_p_hand_cases():
    # top_p = 0.7: token 1 is kept (mass before it 0.5 < 0.7), token 2 is not (0.8 >= 0.7).
    tokens, logp = _sample([0.1, 0.62, 0.63, 0.999], top_p=0.7)
    assert tokens == [0, 0, 1, 1]
    assert logp[-1].item() == pytest.approx(math.log(0.3), abs=1e-6)
    # top_p = 0.5: the mass before token 1 is exactly 0.5, not < 0.5 -> only token 0 (vLLM's rule).
    assert _sample([0.0, 0.7, 0.999], top_p=0.5)[0] == [0, 0, 0]
    # Mass before token 3 is 0.95: kept for top_p = 0.96 (0.95 < 0.96), dropped for 0.95.
    assert _sample([0.999], top_p=0.96)[0] == [3]
    assert _sample([0.999], top_p=0.95)[0] == [2]


def test_top_k_then_top_p_on_the_renormalised_distribution():
    # top-k = 3 renormalises to (0.526, 0.316, 0.158); top_p = 0.8: mass before token 2 is
    # 0.842 >= 0.8 -> dropped, so only tokens 0 and 1 remain (0.625 / 0.375).
    tokens, _ = _sample([0.0, 0.62, 0.63, 0.999], top_k=3, top_p=0.8)
    assert tokens == [0, 0, 1, 1]
    probs, index = truncated_probs(PROBS.log()[None], 3, 0.8)
    assert index[0].tolist() == [0, 1, 2]
    assert probs[0].tolist() == pytest.approx([0.5, 0.3, 0.0], abs=1e-6)


def test_temperature_scales_logprobs_and_sampling():
    # At T = 2 the probabilities are softmax(log p / 2) = sqrt(p) / sum sqrt(p).
    tempered = PROBS.sqrt() / PROBS.sqrt().sum()
    tokens, logp = _sample([0.0, 0.999], temperature=2.0)
    assert tokens == [0, 3]
    assert torch.allclose(logp, tempered.log()[[0, 3]], atol=1e-6)
    cdf = tempered.cumsum(0)
    assert _sample([cdf[0].item() + 1e-4], temperature=2.0)[0] == [1]


def test_greedy_reports_logprob_at_temperature_one():
    tokens, logp = _sample([0.3, 0.9], temperature=0.0)
    assert tokens == [0, 0]
    assert torch.allclose(logp, PROBS.log()[[0, 0]], atol=1e-6)


def test_zero_probability_tokens_are_never_drawn():
    logits = torch.tensor([[0.0, -float("inf"), 0.0, -float("inf")]])
    u = torch.linspace(0, 0.9999, 50, dtype=torch.float64)
    tokens, _ = sample_next(logits.expand(50, -1), u, SamplingParams())
    assert set(tokens.tolist()) == {0, 2}


def test_sampling_frequencies_match_probabilities():
    u = sample_uniforms([derive_seed(3, i) for i in range(20000)], 1)[:, 0]
    tokens, _ = sample_next(LOGITS.expand(len(u), -1), u, SamplingParams())
    freq = torch.bincount(tokens, minlength=4).double() / len(u)
    assert torch.allclose(freq, PROBS.double(), atol=0.015)


def test_uniform_rows_depend_only_on_their_seed():
    a = sample_uniforms([11, 22, 33], 5)
    b = sample_uniforms([22], 5)
    assert torch.equal(a[1], b[0])
    assert torch.equal(a, sample_uniforms([11, 22, 33], 5))
    assert not torch.equal(a[0], a[2])
    assert ((a >= 0) & (a < 1)).all()


def test_seed_derivation_is_stable_and_distinct():
    assert derive_seed(5, 1) == derive_seed(5, 1)
    assert len({derive_seed(5, i) for i in range(100)}) == 100
    assert derive_seed(5, 1) != derive_seed(6, 1)
    assert 0 <= derive_seed(-1, 2**70) < 2**63
    assert prompt_seeds_for(9, [3, 4]) == [derive_seed(9, 3), derive_seed(9, 4)]
    assert prompt_seeds_for(None, [0]) != prompt_seeds_for(None, [0])
    assert row_seeds([7, 8], 2) == [derive_seed(7, 0), derive_seed(7, 1), derive_seed(8, 0), derive_seed(8, 1)]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(n=0), "n"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=0), "top_k"),
        (dict(max_new_tokens=0), "max_new_tokens"),
    ],
)
def test_sampling_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_sampling_params_from_rollout_config():
    from megatron_rl.config.rollout import RolloutConfig

    cfg = RolloutConfig(num_samples_per_prompt=8, temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=32)
    params = SamplingParams.from_rollout_config(cfg, seed=3, stop_token_ids=[2, 5])
    assert (params.n, params.temperature, params.top_p, params.top_k, params.max_new_tokens) == (8, 0.7, 0.9, 20, 32)
    assert params.stop_token_ids == (2, 5) and params.seed == 3
