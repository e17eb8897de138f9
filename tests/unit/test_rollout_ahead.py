"""``RolloutAhead``: the driver's scheduling of generation ahead of the update.

``produce`` here stands in for the pool (it records which weight version the engines
held when each step's generation started); the trainer's side is driven like the
trainer drives it: take step n, update, sync version n inside ``paused``.
"""

from __future__ import annotations

import threading
import time

import pytest

from megatron_rl.config.lib import ConfigError
from megatron_rl.loop.experience import RolloutBatch
from megatron_rl.loop.pipeline import RolloutAhead


class FakePool:
    """Generation that takes ``seconds`` and notes the version the engines held."""

    def __init__(self, seconds: float = 0.01, fail_at: int | None = None):
        self.version = 0
        self.position = 0
        self.started_on: dict[int, int] = {}
        self.seconds = seconds
        self.fail_at = fail_at
        self.busy = threading.Event()

    def cursor(self) -> dict:
        return {"epoch": 0, "position": self.position, "num_rows": 100}

    def produce(self, step: int) -> RolloutBatch:
        if step == self.fail_at:
            raise RuntimeError(f"engine died at step {step}")
        self.busy.set()
        self.started_on[step] = self.version
        self.position += 4  # draws 4 prompts
        time.sleep(self.seconds)
        self.busy.clear()
        return RolloutBatch(step=step, prompts=[step], completions=[], generate_s=self.seconds)


def _drive(ahead: RolloutAhead, pool: FakePool, steps: int, update_s: float = 0.02) -> list[RolloutBatch]:
    out = []
    for step in range(1, steps + 1):
        batch, _ = ahead.take(step)
        out.append(batch)
        time.sleep(update_s)  # the update
        with ahead.paused():
            assert not pool.busy.is_set()  # the sync never overlaps a generation
            pool.version = step
        ahead.synced(step)
    return out


@pytest.mark.parametrize("k", [0, 1, 2])
def test_staleness_never_exceeds_the_bound_and_steps_come_in_order(k):
    pool = FakePool()
    ahead = RolloutAhead(pool.produce, cursor=pool.cursor, max_staleness=k, first_step=1, last_step=8, synced_version=0)
    try:
        batches = _drive(ahead, pool, 8)
    finally:
        ahead.close()
    assert [b.step for b in batches] == list(range(1, 9))
    staleness = {step: (step - 1) - version for step, version in pool.started_on.items()}
    assert max(staleness.values()) <= k
    if k == 0:
        assert set(staleness.values()) == {0}  # the synchronous loop: generate on the latest weights
    else:
        assert max(staleness.values()) == k  # and it does run ahead
    # Each batch's cursor is the data position before its prompts: consecutive, no gap or repeat.
    assert [b.cursor["position"] for b in batches] == [4 * i for i in range(8)]


def test_the_pool_works_during_the_update():
    pool = FakePool(seconds=0.2)
    ahead = RolloutAhead(pool.produce, cursor=pool.cursor, max_staleness=1, first_step=1, last_step=4, synced_version=0)
    start = time.perf_counter()
    try:
        _drive(ahead, pool, 4, update_s=0.2)
    finally:
        ahead.close()
    # serial: 4 x (0.2 generate + 0.2 update) = 1.6 s; overlapped: about 0.2 + 4 x 0.2 + syncs
    assert time.perf_counter() - start < 1.35


def test_checkpoint_cursor_is_before_the_oldest_untrained_batch():
    pool = FakePool(seconds=0.05)
    ahead = RolloutAhead(pool.produce, cursor=pool.cursor, max_staleness=1, first_step=1, last_step=5, synced_version=0)
    try:
        batch, _ = ahead.take(1)
        time.sleep(0.15)  # step 2 is generated (version 0) and waits in the queue
        assert pool.started_on == {1: 0, 2: 0} and 3 not in pool.started_on
        assert ahead.cursor()["position"] == 4  # step 2's prompts would be drawn again on resume
        with ahead.paused():
            pool.version = 1
        ahead.synced(1)
        ahead.take(2)
        with ahead.paused():  # step 3 in flight or done: its prompts are not trained yet either
            assert ahead.cursor()["position"] == 8
    finally:
        ahead.close()


def test_a_failed_generation_is_raised_in_the_trainer():
    pool = FakePool(fail_at=2)
    ahead = RolloutAhead(pool.produce, cursor=pool.cursor, max_staleness=1, first_step=1, last_step=4, synced_version=0)
    try:
        ahead.take(1)
        with pytest.raises(RuntimeError, match="engine died at step 2"):
            ahead.take(2)
    finally:
        ahead.close()


def test_inline_mode_runs_nothing_in_the_background():
    pool = FakePool()
    ahead = RolloutAhead(pool.produce, cursor=pool.cursor, max_staleness=0, first_step=3, last_step=9, synced_version=2)
    assert pool.started_on == {}
    batch, waited = ahead.take(3)
    assert batch.step == 3 and waited == 0.0 and batch.cursor["position"] == 0
    with pytest.raises(RuntimeError, match="next one is step 4"):
        ahead.take(5)
    ahead.close()


def test_async_rollout_config_errors_name_the_field():
    from megatron_rl.config.rollout import RolloutConfig
    from megatron_rl.config.run import RunConfig

    with pytest.raises(ConfigError, match="rollout.max_staleness"):
        RunConfig(rollout=RolloutConfig(max_staleness=1, tis_cap=2.0))  # colocated by default
    with pytest.raises(ConfigError, match="rollout.tis_cap"):
        RunConfig(rollout=RolloutConfig(max_staleness=1, placement="disaggregated"))
    with pytest.raises(ConfigError, match="max_staleness"):
        RolloutConfig(max_staleness=-1)
    RunConfig(rollout=RolloutConfig(max_staleness=1, placement="disaggregated", tis_cap=2.0))
