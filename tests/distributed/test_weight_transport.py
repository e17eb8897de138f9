"""The host weight transports of the run's sync path (``weight_sync.WeightSync``: object
store, shared memory, gloo collective) from actor layouts TP1/PP1, TP2 x PP2 and DP2 into
a pool of 2 built-in engines: after each sync every engine's weights are bit-identical to
the actor's HF weights gathered on every rank (SHA-256 per tensor), while the sync itself
gathers them on the sending rank only. An engine that dies mid-sync is
restarted and the sync retried: the pool ends consistent (every engine on the new
version, bit-identical), never half-updated."""

import hashlib

import pytest
import torch

ray = pytest.importorskip("ray")

from megatron_rl.actor.spec import ActorSpec  # noqa: E402
from megatron_rl.cluster.placement import GroupPlacement  # noqa: E402
from megatron_rl.config.parallel import ParallelConfig  # noqa: E402
from megatron_rl.config.rollout import PoolConfig, RolloutConfig
from megatron_rl.config.trainer import TrainerConfig
from megatron_rl.rollout import RolloutPool  # noqa: E402
from megatron_rl.weight_sync.buckets import make_buckets  # noqa: E402
from megatron_rl.weight_sync.meta import TensorMeta  # noqa: E402
from megatron_rl.weight_sync.sync import WeightSync  # noqa: E402
from tests.helpers.actor_groups import ActorGroups
from tests.helpers.rollout_models import ACTOR_HF_CONFIG as HF_CONFIG  # noqa: E402
from tests.helpers.rollout_models import save_actor_hf  # noqa: E402
from tests.ray_cluster import shared_ray

LAYOUTS = {"tp1": (1, 1, 1), "tp2_pp2": (2, 2, 1), "dp2": (1, 1, 2)}
"""(TP, PP, DP): at TP 2 x PP 2 stage 1's TP ranks gather to their first rank, which sends
the unit to rank 0; at DP 2 the second replica takes part in nothing."""
TRANSPORTS = {"object_store": "object_store", "shared_memory": "object_store", "collective": "gloo"}
BUCKETS = ("object_store", "shared_memory")  # the pool keeps what it loaded: it restores a dead engine itself


def _digests(state):
    return {n: hashlib.sha256(t.contiguous().view(torch.uint8).numpy()).hexdigest() for n, t in state.items()}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("weight_transport")
    other = save_actor_hf(root / "other", seed=123)
    shared_ray("distributed")
    # The module's kill tests can cost one engine four deaths (which engine the armed fault
    # hits is a race, and the collective's repair kills both engines once more), more than
    # the default max_restarts=3 allows.
    config = RolloutConfig(
        engine="tests.helpers.rollout_engines:FaultOnSyncEngine", engine_args={"arm_file": str(root / "arm")},
        num_engines=2, pool=PoolConfig(restart_timeout_s=120, weight_sync_timeout_s=60, max_restarts=10),
    )  # fmt: skip
    pool = RolloutPool(config, str(other), placement=GroupPlacement.uniform(2, num_cpus=1), weight_backend="gloo")
    state = {"version": 0}

    def reset():  # other weights into every engine, so the next sync has work to do
        from safetensors.torch import load_file

        named = load_file(str(other / "model.safetensors"))
        state["version"] += 1
        pool.sync(make_buckets(named.items(), 1 << 14), version=state["version"],
                  metas=[TensorMeta.of(n, t) for n, t in named.items()])  # fmt: skip
        return state["version"]

    try:
        yield pool, reset, root / "arm", state
    finally:
        pool.shutdown()


def _engine_digests(pool):
    return [ray.get(actor.weight_checksums.remote()) for actor in pool.actors]


def _spec(tp, pp, dp=1):
    return ActorSpec(
        architecture=dict(HF_CONFIG),
        parallel=ParallelConfig(
            num_actor_ranks=tp * pp * dp, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
        ),
        trainer=TrainerConfig(seed=7),
    )


@pytest.fixture(scope="module")
def groups(env):
    """The module's actor groups, one per rank count (DP2 and the TP2 below share two ranks)."""
    groups = ActorGroups()
    yield groups
    groups.shutdown()


def _sync(actors, pool, transport):
    rollout = RolloutConfig(weight_transport=transport, weight_sync_bucket_mb=1, pool=pool.config.pool)
    return WeightSync(actors, pool, rollout, transport=transport, backend=TRANSPORTS[transport])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_transport_gives_every_engine_the_actor_weights_bit_for_bit(env, groups, layout):
    pool, reset, _, state = env
    actors = groups.get(_spec(*LAYOUTS[layout]))
    want = _digests(actors.hf_state_dict())
    for transport in TRANSPORTS:
        reset()
        assert all(d != want for d in _engine_digests(pool))
        sync = _sync(actors, pool, transport)
        try:
            state["version"] += 1
            stats = sync.run(state["version"])
        finally:
            sync.close()
        assert stats["weight_sync/retries"] == 0 and stats["weight_sync/num_engines"] == 2
        assert sync.transport == transport
        assert _engine_digests(pool) == [want, want], (layout, transport)
        assert all(h["ok"] and h["weight_version"] == state["version"] for h in pool.health())


@pytest.fixture(scope="module")
def tp2_actors(groups):
    """A TP=2 actor group the killed-engine cases share: a sync reads its weights and changes
    nothing of it (one group's start-up instead of one per case)."""
    return groups.get(_spec(2, 1))


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_engine_killed_mid_sync_leaves_the_pool_consistent(env, tp2_actors, transport):
    pool, reset, arm, state = env
    actors = tp2_actors
    want = _digests(actors.hf_state_dict())
    reset()
    before = {h["engine"]: h["pid"] for h in pool.health()}
    sync = _sync(actors, pool, transport)
    try:
        arm.write_text("exit")  # the first engine to load a tensor of this sync exits
        state["version"] += 1
        stats = sync.run(state["version"])
    finally:
        sync.close()
    assert not arm.exists()
    # object store, shared memory: the pool restores the dead engine from the sync's
    # buckets (the shared file's descriptor) itself; collective: the group is broken, so
    # WeightSync restarts, rebuilds and retries once
    assert stats["weight_sync/retries"] == (0 if transport in BUCKETS else 1)
    health = pool.health()
    assert all(h["ok"] for h in health), health
    after = {h["engine"]: h["pid"] for h in health}
    restarted = {e for e in before if after[e] != before[e]}
    # the killed engine, and with a collective also any engine that had received part of it
    assert len(restarted) == 1 if transport in BUCKETS else len(restarted) >= 1, restarted
    assert _engine_digests(pool) == [want, want]
    assert all(h["weight_version"] == state["version"] for h in health)
