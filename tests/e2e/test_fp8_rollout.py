"""An RL run whose engines get FP8 weights (``rollout.weight_dtype: fp8``): it trains, and
the log-prob mismatch metric shows the FP8 drift that the float32 run does not have."""

import math

from megatron_rl.loop.pipeline import make_trainer
from megatron_rl.observability import read_metrics
from tests.e2e.conftest import tiny_config

STEPS = ("trainer.num_steps=3", "trainer.eval_every_steps=0", "trainer.save_every_steps=0")


def _rows(out_dir, *extra):
    trainer = make_trainer(tiny_config(out_dir, *STEPS, *extra))
    try:
        trainer.run()
        return {r["step"]: r for r in read_metrics(trainer.parts.checkpoint_dir.parent)}
    finally:
        trainer.close()


def test_fp8_rollout_weights_train_and_show_their_drift(tmp_path, ray_session):
    fp8 = _rows(tmp_path / "fp8", "rollout.weight_dtype=fp8")
    full = _rows(tmp_path / "full")
    assert sorted(fp8) == [1, 2, 3]
    for step, row in fp8.items():
        assert math.isfinite(row["loss/total"]) and math.isfinite(row["actor/grad_norm"])
        assert row["weight_sync/version"] == step
        # every step's engine ran on FP8-rounded weights, the actor on float32 ones
        assert 1e-3 < row["rollout/logp_mismatch/max_abs"] < 1.0, row["rollout/logp_mismatch/max_abs"]
        assert full[step]["rollout/logp_mismatch/max_abs"] < 1e-4
    # FP8 sends fewer bytes: projection weights at 1 byte per element plus their scales
    assert fp8[1]["weight_sync/bytes"] < full[1]["weight_sync/bytes"]
