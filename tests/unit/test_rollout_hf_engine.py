"""The HF rollout engine in-process: log-probs vs a transformers forward, seeds, stops, weights."""

import pytest
import torch

from megatron_rl.config.seeding import prompt_seeds_for
from megatron_rl.rollout.engines.base import EngineAsleepError
from megatron_rl.rollout.engines.hf import HFEngine
from megatron_rl.rollout.generation import SamplingParams
from tests.helpers.rollout_models import VOCAB, build_qwen2, hf_state, reference_logprobs, save_qwen2

# Different lengths, so the batch is left-padded (the longest is 17 tokens).
PROMPTS = [[1, 2, 3], [5] * 9, [7, 8], list(range(20, 37)), [3]]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout_hf")
    return save_qwen2(root / "a", seed=0), save_qwen2(root / "b", seed=7)


@pytest.fixture(scope="module")
def engine(ckpts):
    return HFEngine(ckpts[0], num_threads=1)


def _ids(results):
    return [[c.token_ids for c in group] for group in results]


def _check_logprobs(model, prompts, results, temperature, atol=1e-4):
    worst = 0.0
    for prompt, group in zip(prompts, results):
        for c in group:
            ref = reference_logprobs(model, prompt, c.token_ids, temperature)
            worst = max(worst, (ref - torch.tensor(c.logprobs)).abs().max().item())
    assert worst <= atol


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(n=3, temperature=0.7, max_new_tokens=12, seed=5),
        # Truncation changes what is sampled, not what is reported: still the full softmax at T.
        SamplingParams(n=2, temperature=1.3, top_k=5, top_p=0.8, max_new_tokens=10, seed=6),
        SamplingParams(n=1, temperature=0.0, max_new_tokens=6, seed=0),
    ],
    ids=["T0.7", "T1.3-topk-topp", "greedy"],
)
def test_logprobs_match_a_transformers_forward(engine, params):
    results = engine.generate(PROMPTS, params)
    assert [len(g) for g in results] == [params.n] * len(PROMPTS)
    _check_logprobs(build_qwen2(0), PROMPTS, results, params.temperature)
    for group in results:
        for c in group:
            assert len(c.token_ids) == len(c.logprobs) == params.max_new_tokens
            assert c.finish_reason == "length" and c.weight_version == 0 and c.engine == "hf"


def test_determinism_and_batch_independence(engine):
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=8, seed=11)
    first = engine.generate(PROMPTS, params)
    assert _ids(engine.generate(PROMPTS, params)) == _ids(first)
    # The n samples of a prompt are different draws.
    assert len({tuple(t) for t in _ids(first)[3]}) == 3
    # Another seed, other samples.
    assert _ids(engine.generate(PROMPTS, SamplingParams(n=3, max_new_tokens=8, seed=12))) != _ids(first)
    # A prompt alone, with its seed from the full call, samples the same tokens.
    alone = engine.generate([PROMPTS[2]], params, prompt_seeds=prompt_seeds_for(11, [2]))
    assert _ids(alone)[0] == _ids(first)[2]
    # Splitting into small chunks (2 rows at a time) changes nothing either.
    chunked = HFEngine(engine.model_path, max_batch_rows=2)
    assert _ids(chunked.generate(PROMPTS, params)) == _ids(first)


def test_stop_tokens_end_samples(engine):
    base = SamplingParams(n=4, temperature=1.0, max_new_tokens=10, seed=3)
    free = engine.generate(PROMPTS, base)
    stop = free[0][0].token_ids[0]  # the first token of sample 0 of prompt 0
    stopped = engine.generate(PROMPTS, SamplingParams(n=4, temperature=1.0, max_new_tokens=10, seed=3,
                                                      stop_token_ids=[stop, VOCAB + 5]))  # fmt: skip
    assert stopped[0][0].token_ids == [stop] and stopped[0][0].finish_reason == "stop"
    for free_group, group in zip(free, stopped):
        for f, c in zip(free_group, group):
            if stop in f.token_ids:  # the same draws up to (and including) the first stop token
                cut = f.token_ids.index(stop) + 1
                assert c.token_ids == f.token_ids[:cut] and c.finish_reason == "stop"
                assert c.logprobs == pytest.approx(f.logprobs[:cut], abs=1e-5)
            else:
                assert c.token_ids == f.token_ids and c.finish_reason == "length"


def test_every_sample_stopping_at_once_ends_the_loop(engine):
    # top_k = 1 makes every sample greedy; stopping on each prompt's first greedy token
    # finishes every row at step 0.
    greedy = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=1))
    stops = sorted({g[0].token_ids[0] for g in greedy})
    out = engine.generate(PROMPTS, SamplingParams(n=2, top_k=1, max_new_tokens=20, stop_token_ids=stops, seed=1))
    assert all(c.finish_reason == "stop" and len(c.token_ids) == 1 for g in out for c in g)


def test_top_k_one_is_greedy(engine):
    greedy = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=8))
    top1 = engine.generate(PROMPTS, SamplingParams(n=2, temperature=0.9, top_k=1, max_new_tokens=8, seed=4))
    for g, t in zip(greedy, top1):
        assert t[0].token_ids == t[1].token_ids == g[0].token_ids
    _check_logprobs(build_qwen2(0), PROMPTS, top1, 0.9)


def test_update_weights_equals_a_fresh_engine(ckpts):
    params = SamplingParams(n=2, temperature=0.8, max_new_tokens=10, seed=21)
    engine = HFEngine(ckpts[0])
    before = engine.generate(PROMPTS, params)
    stats = engine.update_weights(hf_state(ckpts[1]).items(), version=3)
    assert stats["num_tensors"] == len(hf_state(ckpts[1]))
    after = engine.generate(PROMPTS, params)
    fresh = HFEngine(ckpts[1]).generate(PROMPTS, params)
    assert _ids(after) == _ids(fresh) != _ids(before)
    for a, f in zip(after, fresh):
        for ca, cf in zip(a, f):
            assert ca.logprobs == pytest.approx(cf.logprobs, abs=1e-6)
            assert ca.weight_version == 3 and cf.weight_version == 0


def test_update_weights_rejects_unknown_names_and_shapes(engine):
    with pytest.raises(KeyError, match="model.layers.9.mlp.up_proj.weight"):
        engine.update_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(1))], version=1)
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights([("model.norm.weight", torch.zeros(3))], version=1)


def test_sleep_and_wake(ckpts):
    engine = HFEngine(ckpts[0])
    params = SamplingParams(n=2, max_new_tokens=5, seed=2)
    before = engine.generate(PROMPTS, params)
    engine.sleep()
    assert engine.sleeping and engine.health()["sleeping"]
    with pytest.raises(EngineAsleepError):
        engine.generate(PROMPTS, params)
    engine.update_weights(hf_state(ckpts[0]).items(), version=1)  # allowed while asleep
    engine.wake()
    assert not engine.sleeping
    assert _ids(engine.generate(PROMPTS, params)) == _ids(before)
    assert engine.health()["weight_version"] == 1


def test_bad_requests_name_the_prompt(engine):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1], []], SamplingParams())
    with pytest.raises(ValueError, match=f"prompt 0 has token id {VOCAB}"):
        engine.generate([[VOCAB]], SamplingParams())
    with pytest.raises(ValueError, match="prompt 0 has 250 tokens"):
        engine.generate([[1] * 250], SamplingParams(max_new_tokens=10))
    with pytest.raises(ValueError, match="accepts"):
        HFEngine(engine.model_path, no_such_arg=1)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_an_engine_from_a_config_alone_waits_for_its_first_update(tmp_path, tied):
    """A directory with a config and no weights (the run's ``engine_init``): the engine
    expects exactly the checkpoint's tensors, refuses to generate at version -1, and after
    the update serves like an engine started from those weights."""
    from megatron_rl.rollout.engines.base import EngineWeightsInvalidError
    from megatron_rl.weight_sync.receiver import checkpoint_tensors, has_weights

    full = save_qwen2(tmp_path / "full", seed=3, tie_word_embeddings=tied)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((full / "config.json").read_text())
    assert has_weights(full) and not has_weights(bare)
    assert checkpoint_tensors(bare, torch.float32) == checkpoint_tensors(full, torch.float32)

    engine = HFEngine(bare)
    assert engine.weight_version == -1 and engine.health()["ok"] is False
    params = SamplingParams(n=2, temperature=0.8, max_new_tokens=6, seed=4)
    with pytest.raises(EngineWeightsInvalidError):
        engine.generate(PROMPTS, params)
    engine.update_weights(hf_state(full).items(), version=0)
    assert engine.weight_version == 0 and engine.health()["ok"] is True
    got, want = engine.generate(PROMPTS, params), HFEngine(full).generate(PROMPTS, params)
    assert _ids(got) == _ids(want)
    for a, b in zip(got, want):
        for ca, cb in zip(a, b):
            assert ca.logprobs == pytest.approx(cb.logprobs, abs=1e-6)


def test_a_moe_engine_returns_the_experts_its_routers_chose_for_every_token_it_ran(tmp_path):
    """Left-padded prefill, decoding rows that stop at different steps: each completion's
    ``routed_experts`` equals the routers' choices in a teacher-forced forward of its prompt
    and its tokens but the last (batch-major flattening undone, padding stripped)."""
    from transformers import AutoModelForCausalLM

    from tests.helpers.tiny_hf import save_model

    path = save_model("qwen3_moe", tmp_path / "moe", seed=3)
    engine = HFEngine(path, num_threads=1, return_routed_experts=True)
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=8, seed=4, stop_token_ids=(5, 9, 11, 17))
    prompts = [[1, 2, 3], [5] * 9, [7, 8]]
    results = engine.generate(prompts, params)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gates = [layer.mlp.gate for layer in model.model.layers]
    lengths = set()
    for prompt, group in zip(prompts, results):
        for c in group:
            seen = []
            handles = [g.register_forward_hook(lambda m, a, out: seen.append(out[2])) for g in gates]
            with torch.no_grad():
                model(torch.tensor([prompt + c.token_ids[:-1]]))
            for h in handles:
                h.remove()
            want = torch.stack(seen, dim=1).to(torch.int16)  # [P + L - 1, layers, k]
            assert c.routed_experts.dtype == torch.int16
            assert torch.equal(c.routed_experts.sort(-1).values, want.sort(-1).values)
            lengths.add(len(c.token_ids))
    assert len(lengths) > 1  # some rows stopped early
    with pytest.raises(ValueError, match="return_routed_experts: the model has no mixture-of-experts"):
        HFEngine(save_qwen2(tmp_path / "dense", seed=0), return_routed_experts=True)
