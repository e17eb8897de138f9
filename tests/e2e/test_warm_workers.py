"""Runs built on kept processes (``loop.warm.WarmWorkers``) are runs on new ones.

The e2e tier's in-process runs hand their actor ranks and engines on to each other
(``tests/helpers/warm_workers.py``); this checks the premise: a run whose processes
served another run before (another seed, a reference policy, a checkpoint) logs what a
run on new processes logs, and kept processes that died are replaced, not reused.
"""

from __future__ import annotations

import math
import os

import pytest
import ray

from megatron_rl.loop.pipeline import make_trainer
from megatron_rl.loop.warm import WarmWorkers
from megatron_rl.observability import read_metrics
from tests.e2e.conftest import BASELINE, KL_RUN, tiny_config
from tests.ray_cluster import release_ray, shared_ray

pytestmark = pytest.mark.e2e

WALL_CLOCK = ("time", "timing_s/", "throughput/", "weight_sync/seconds", "weight_sync/put_seconds",
              "weight_sync/gib_per_s")  # fmt: skip
"""Metrics that measure time: they differ between any two runs."""


def _pid(actor) -> int:
    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))


def _train(config, warm=None):
    trainer = make_trainer(config, warm=warm)
    try:
        trainer.run()
        parts = trainer.parts
        pids = [_pid(w) for w in parts.actors.workers] + [_pid(e) for e in parts.pool.actors]
        engine = ray.get(parts.pool.actors[0].get_transitions.remote())
        actor = parts.actors.transitions()
        events = [e for _, e in sorted([(t, f"engine:{e}") for t, e in engine] + [(t, f"actor:{e}") for t, e in actor])]
    finally:
        trainer.close()
    return {r["step"]: r for r in read_metrics(config.run_dir)}, pids, events


def test_a_run_on_kept_processes_logs_what_a_run_on_new_ones_does(tmp_path):
    # A cluster of the test's own: the engines other tests' runs keep hold Ray CPUs the
    # run on new processes below needs (the tier's cluster has as many as the machine's cores).
    release_ray()
    shared_ray("e2e")
    warm = WarmWorkers()
    try:
        # Another seed, a reference policy and a checkpoint first: all of it must go.
        _, first_pids, _ = _train(tiny_config(tmp_path / "first", *KL_RUN, "trainer.seed=2"), warm)
        kept, kept_pids, kept_events = _train(tiny_config(tmp_path / "kept", *BASELINE), warm)
        assert warm.started == warm.reused == {"actor_groups": 1, "pools": 1}
        assert kept_pids == first_pids  # the same processes
        fresh, fresh_pids, fresh_events = _train(tiny_config(tmp_path / "fresh", *BASELINE))
        assert set(fresh_pids).isdisjoint(kept_pids)
        assert kept_events == fresh_events  # the kept processes' history starts with the run
        assert sorted(kept) == sorted(fresh) == [1, 2, 3]
        for step in fresh:
            assert set(kept[step]) == set(fresh[step])
            for key, value in fresh[step].items():
                if key.startswith(WALL_CLOCK):
                    continue
                same = value == kept[step][key] or (isinstance(value, float) and math.isnan(value)
                                                    and math.isnan(kept[step][key]))  # fmt: skip
                assert same, (step, key, value, kept[step][key])

        # Kept processes that died are stopped and replaced by new ones.
        for _, group in warm._groups:
            ray.kill(group.workers[0])
        for _, engines in warm._engines:
            ray.kill(engines[0], no_restart=True)
        _, replaced_pids, _ = _train(tiny_config(tmp_path / "replaced", *BASELINE), warm)
        assert set(replaced_pids).isdisjoint(kept_pids)
        assert warm.started == {"actor_groups": 2, "pools": 2} and warm.reused == {"actor_groups": 1, "pools": 1}
    finally:
        warm.close()
