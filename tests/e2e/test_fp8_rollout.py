"""An RL run whose engines get FP8 weights (``rollout.weight_dtype: fp8``): it trains, and
the log-prob mismatch metric shows the FP8 drift that the float32 run does not have."""

import math

from tests.e2e.conftest import BASELINE


def test_fp8_rollout_weights_train_and_show_their_drift(tiny_run):
    fp8 = tiny_run(*BASELINE, "rollout.weight_dtype=fp8").rows
    full = tiny_run(*BASELINE).rows  # the session's shared 3-step run
    assert sorted(fp8) == [1, 2, 3]
    for step, row in fp8.items():
        assert math.isfinite(row["loss/total"]) and math.isfinite(row["actor/grad_norm"])
        assert row["weight_sync/version"] == step
        # every step's engine ran on FP8-rounded weights, the actor on float32 ones
        assert 1e-3 < row["rollout/logp_mismatch/max_abs"] < 1.0, row["rollout/logp_mismatch/max_abs"]
        assert full[step]["rollout/logp_mismatch/max_abs"] < 1e-4
    # FP8 sends fewer bytes: projection weights at 1 byte per element plus their scales
    assert fp8[1]["weight_sync/bytes"] < full[1]["weight_sync/bytes"]
