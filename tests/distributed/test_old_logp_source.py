"""The on-policy fast path for the old log-probs (``actor.old_logp_source: auto``).

The first optimizer step of an RL step runs the old policy's own weights, so its
mini-batch takes the old log-probs from its train forward instead of a separate
forward-only pass; the other rows are still recomputed before any update. These tests
run two RL steps through the whole update (``update_policy`` on a 2-rank Ray actor
group) once with ``auto`` and once with ``recompute`` from the same initial weights and
check the two give the same updated weights, losses, gradient norms and engine-mismatch
metrics, for a plain one-mini-batch GRPO step (PP=2: the log-probs come back from the
last stage) and for Lopti + STAPO + TR-GRPO + KL + entropy with 2 mini-batches x 2
epochs (DP=2: the rows are split over ranks), each also with truncated importance
sampling (``rollout.tis_cap``: the fast path's first step applies the weights inside the
loss, from its own forward's log-probs; STAPO's pre-pass is left out there, since it
turns the fast path off).
"""

from dataclasses import replace

import pytest
import torch

ray = pytest.importorskip("ray")

from megatron_rl.actor.batch import ActorBatch  # noqa: E402
from megatron_rl.actor.group import ActorGroup  # noqa: E402
from megatron_rl.actor.spec import ActorSpec  # noqa: E402
from megatron_rl.actor.update import old_logp_from_train_forward  # noqa: E402
from megatron_rl.algo import AlgorithmConfig, ARConfig, LoptiConfig, STAPOConfig, TRGRPOConfig  # noqa: E402
from megatron_rl.cluster.placement import GroupPlacement  # noqa: E402
from megatron_rl.config.parallel import ParallelConfig  # noqa: E402
from megatron_rl.config.rollout import RolloutConfig
from megatron_rl.config.trainer import ActorConfig, TrainerConfig
from tests.helpers.actor_groups import ActorGroups
from tests.helpers.rollout_models import ACTOR_HF_CONFIG  # noqa: E402
from tests.ray_cluster import shared_ray

N, L, PROMPT = 8, 14, 4
TOL = 2e-5  # float32: the two paths' forwards batch the rows differently


@pytest.fixture(scope="module")
def groups():
    """The module's 2-rank group, rebuilt for each run (every case has 2 ranks)."""
    shared_ray("distributed")
    groups = ActorGroups()
    yield groups
    groups.shutdown()


def _batch() -> ActorBatch:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, ACTOR_HF_CONFIG["vocab_size"], (N, L), generator=g)
    lengths = torch.randint(PROMPT + 3, L + 1, (N,), generator=g)
    attn = (torch.arange(L)[None] < lengths[:, None]).long()
    loss_mask = attn.clone()
    loss_mask[:, :PROMPT] = 0
    advantages = torch.randn(N, 1, generator=g).expand(N, L).clone()
    engine_logp = -torch.rand(N, L, generator=g) * 6  # stands in for the engines' log-probs
    return ActorBatch(input_ids=ids, attention_mask=attn, loss_mask=loss_mask, advantages=advantages,
                      engine_logp=engine_logp)  # fmt: skip


def _train(actors: ActorGroup, steps: int = 2) -> tuple[list[dict], dict]:
    """``steps`` RL steps on the same batch: each step's metrics and the final weights."""
    batch = _batch()
    metrics = [actors.update_policy(batch, step) for step in range(1, steps + 1)]
    return metrics, actors.hf_state_dict()


def _run(groups: ActorGroups, spec: ActorSpec, source: str) -> tuple[list[dict], dict]:
    return _train(groups.get(replace(spec, actor=replace(spec.actor, old_logp_source=source))))


CASES = {
    "grpo_pp2_one_minibatch": (
        ParallelConfig(num_actor_ranks=2, pipeline_model_parallel_size=2),
        TrainerConfig(seed=7, lr=1e-2),
        AlgorithmConfig(),
        1.0,
    ),
    "methods_dp2_2mb_2ep": (
        ParallelConfig(num_actor_ranks=2),
        TrainerConfig(seed=7, lr=1e-2, num_minibatches_per_step=2, num_epochs_per_step=2),
        AlgorithmConfig(
            kl_coef=0.01, entropy_coef=0.01,
            lopti=LoptiConfig(enabled=True, eta=0.05),
            stapo=STAPOConfig(enabled=True, tau_p=0.05, entropy_quantile=0.75),
            tr_grpo=TRGRPOConfig(enabled=True),
        ),  # fmt: skip
        0.5,
    ),
}


@pytest.mark.parametrize("tis_cap", [None, 1.5], ids=["no_tis", "tis"])
@pytest.mark.parametrize("case", list(CASES))
def test_auto_equals_recompute(groups, case, tis_cap):
    parallel, trainer, algorithm, frac = CASES[case]
    if tis_cap is not None:  # STAPO's pre-pass with TIS turns the fast path off (tested below)
        algorithm = replace(algorithm, stapo=STAPOConfig())
    spec = ActorSpec(architecture=dict(ACTOR_HF_CONFIG), parallel=parallel, trainer=trainer, algorithm=algorithm,
                     rollout=RolloutConfig(temperature=0.7, tis_cap=tis_cap))  # fmt: skip
    fast, fast_weights = _run(groups, spec, "auto")
    slow, slow_weights = _run(groups, spec, "recompute")
    for f, s in zip(fast, slow):
        assert f["actor/old_logp_from_forward_frac"] == frac and s["actor/old_logp_from_forward_frac"] == 0.0
        keys = ["loss/total", "actor/grad_norm", "rollout/logp_mismatch/mean_abs", "rollout/logp_mismatch/max_abs"]
        if tis_cap is not None:
            keys += ["rollout/tis/weight_mean", "rollout/tis/clip_frac"]
            assert 0 < s["rollout/tis/clip_frac"] < 1 and s["rollout/tis/weight_mean"] != 1.0  # the weights matter
        for key in keys:
            assert f[key] == pytest.approx(s[key], rel=TOL, abs=TOL), key
    assert slow[0]["actor/grad_norm"] > 0 and slow[1]["actor/grad_norm"] != slow[0]["actor/grad_norm"]  # it trained
    assert fast_weights.keys() == slow_weights.keys()
    for name in slow_weights:
        torch.testing.assert_close(fast_weights[name], slow_weights[name], rtol=TOL, atol=TOL, msg=name)


def test_auto_falls_back_when_old_logp_is_needed_before_the_forward():
    spec = ActorSpec(architecture=dict(ACTOR_HF_CONFIG))
    assert old_logp_from_train_forward(spec)
    assert not old_logp_from_train_forward(replace(spec, algorithm=AlgorithmConfig(ar=ARConfig(alpha=0.3))))
    # TIS: the loss applies the first step's weights itself, unless a pre-pass (STAPO's)
    # would read the weighted advantages before the forward.
    assert old_logp_from_train_forward(replace(spec, rollout=RolloutConfig(tis_cap=2.0)))
    stapo = replace(spec, algorithm=AlgorithmConfig(stapo=STAPOConfig(enabled=True)))
    assert old_logp_from_train_forward(stapo)
    assert not old_logp_from_train_forward(replace(stapo, rollout=RolloutConfig(tis_cap=2.0)))
    assert not old_logp_from_train_forward(replace(spec, actor=ActorConfig(old_logp_source="recompute")))
    # Lopti reads the old log-probs inside the loss (its split), STAPO in its pre-pass: both fine.
    lopti = AlgorithmConfig(lopti=LoptiConfig(enabled=True), stapo=STAPOConfig(enabled=True))
    assert old_logp_from_train_forward(replace(spec, algorithm=lopti))


def test_a_rebuilt_group_trains_as_a_new_one(groups):
    """What the module's shared group rests on: ranks rebuilt for a spec, after a spec of
    another layout (PP=2 -> DP=2 -> PP=2), give bit for bit the metrics and weights of
    ranks started for it."""
    specs = {case: ActorSpec(architecture=dict(ACTOR_HF_CONFIG), parallel=parallel, trainer=trainer,
                             algorithm=algorithm, rollout=RolloutConfig(temperature=0.7))
             for case, (parallel, trainer, algorithm, _) in CASES.items()}  # fmt: skip
    pp2, dp2 = specs["grpo_pp2_one_minibatch"], specs["methods_dp2_2mb_2ep"]
    new = ActorGroup(pp2, GroupPlacement.uniform(2, num_cpus=0))
    try:
        want = _train(new)
    finally:
        new.shutdown()
    shared = groups.get(dp2)
    _train(shared, steps=1)
    shared.rebuild(pp2)
    got = _train(shared)
    def numbers(metrics):  # the steps' numbers; their timings differ from run to run
        return [{k: v for k, v in m.items() if not k.startswith(("timing_s/", "throughput/"))} for m in metrics]

    assert numbers(got[0]) == numbers(want[0])
    assert got[1].keys() == want[1].keys()
    for name in want[1]:
        assert torch.equal(got[1][name], want[1][name]), name
