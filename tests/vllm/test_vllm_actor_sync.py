"""The Megatron actor's weights into a real vLLM engine through the run's weight-sync path
(``weight_sync.WeightSync``), from actor layouts TP1/PP1, TP2 and PP2: transport
``collective`` (a gloo group of actor rank 0 and the engine's workers, driven through
vLLM's weight-transfer API) from each, and from TP2 also ``object_store`` and
``shared_memory`` (buckets, or the shared file's descriptor, which the engine loads into
its workers over its own gloo group).

The reference is the same engine after an object-store load of the HF checkpoint the
actors start from (that path equals a fresh engine: tests/vllm/test_vllm_engine.py). After
each layout's sync the engine must hold exactly those weights (vLLM's per-parameter
checksums), generate the same tokens at the same seeds, and its sampled-token log-probs
must match the actor's own recomputation (the trainer's mismatch metric) to 1e-4. Between
layouts the engine is reset to other weights, so each sync has something to do.
"""

import pytest
import torch

from megatron_rl.actor.spec import ActorSpec
from megatron_rl.algo.mismatch import logprob_mismatch
from megatron_rl.cluster.placement import GroupPlacement
from megatron_rl.config.parallel import ParallelConfig
from megatron_rl.config.rollout import RolloutConfig
from megatron_rl.config.trainer import TrainerConfig
from megatron_rl.loop.experience import build_experience
from megatron_rl.rollout import RolloutPool, SamplingParams
from megatron_rl.weight_sync.buckets import MIB, make_buckets
from megatron_rl.weight_sync.meta import TensorMeta
from megatron_rl.weight_sync.sync import WeightSync
from tests.helpers.actor_groups import ActorGroups
from tests.helpers.rollout_models import VLLM_MODEL, hf_state, save_qwen2, vllm_engine_args
from tests.ray_cluster import shared_ray

ray = pytest.importorskip("ray")

PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [8, 9], list(range(20, 31))]
PARAMS = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=11)
LAYOUTS = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}


def _ids(results):
    return [[c.token_ids for c in group] for group in results]


def _load(pool, directory, version):
    state = hf_state(directory)
    metas = [TensorMeta.of(name, tensor) for name, tensor in state.items()]
    pool.sync(make_buckets(state.items(), MIB), version=version, metas=metas)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_actor_sync")
    actor_dir = save_qwen2(root / "actor", seed=5, **VLLM_MODEL)
    other_dir = save_qwen2(root / "other", seed=9, **VLLM_MODEL)
    shared_ray("vllm")
    pool = RolloutPool(RolloutConfig(engine="vllm", engine_args=vllm_engine_args()), str(other_dir),
                       placement=GroupPlacement.uniform(1, num_cpus=1), weight_backend="gloo")  # fmt: skip
    groups = ActorGroups(num_cpus=0.5)  # TP2 and PP2 on the same two ranks
    try:
        _load(pool, actor_dir, version=100)
        reference = pool.generate(PROMPTS, PARAMS), ray.get(pool.actors[0].weight_checksums.remote())
        yield pool, actor_dir, other_dir, reference, groups
    finally:
        groups.shutdown()
        pool.shutdown()


TRANSPORTS = {"collective": "gloo", "object_store": "object_store", "shared_memory": "object_store"}
"""Each host transport into vLLM (backend as ``weight_sync.resolve_transport`` picks it on
CPU); the TP2 layout runs all three, the others the collective one."""


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sync_from_actor_layout_equals_the_checkpoint(setup, layout):
    pool, actor_dir, other_dir, (want, want_checksums), groups = setup
    tp, pp = LAYOUTS[layout]
    spec = ActorSpec(
        architecture=str(actor_dir),
        parallel=ParallelConfig(num_actor_ranks=tp * pp, tensor_model_parallel_size=tp,
                                pipeline_model_parallel_size=pp),
        trainer=TrainerConfig(seed=7),
    )  # fmt: skip
    actors = groups.get(spec)
    actors.load_initial_weights(str(actor_dir))
    for version, transport in enumerate(TRANSPORTS if layout == "tp2" else ["collective"], start=1):
        _load(pool, other_dir, version=200 + version)  # the engine holds other weights before the sync
        assert ray.get(pool.actors[0].weight_checksums.remote()) != want_checksums
        rollout = RolloutConfig(engine="vllm", weight_transport=transport, weight_sync_bucket_mb=1)
        sync = WeightSync(actors, pool, rollout, transport=transport, backend=TRANSPORTS[transport])
        try:
            stats = sync.run(version=version)
        finally:
            sync.close()
        assert stats["weight_sync/retries"] == 0 and stats["weight_sync/num_engines"] == 1
        assert pool.weight_version == version
        assert ray.get(pool.actors[0].weight_checksums.remote()) == want_checksums, transport
        got = pool.generate(PROMPTS, PARAMS)
        assert _ids(got) == _ids(want), transport
        assert all(c.weight_version == version for g in got for c in g)
        # the engine's log-probs vs the actor's recomputation: the trainer's mismatch metric
        exp = build_experience(PROMPTS, got, pad_id=0)
        actor_lp = actors.compute_logprobs(exp.batch).logp
        metrics = logprob_mismatch(exp.batch.engine_logp, actor_lp, exp.batch.loss_mask).metrics
        assert metrics["rollout/logp_mismatch/max_abs"] <= 1e-4, (transport, metrics)
        assert torch.isfinite(actor_lp).all()
