"""The default bound of a call on the actor ranks (``actor.call_timeout_s: null``): the
floor plus the largest rank's share of a checkpoint at a slow file system's speed."""

from __future__ import annotations

import pytest

from megatron_rl.actor.group import (
    CHECKPOINT_BYTES_PER_PARAMETER,
    MIN_CALL_TIMEOUT_S,
    SLOW_WRITE_BYTES_PER_S,
    default_call_timeout_s,
)
from megatron_rl.config.lib import ConfigError
from megatron_rl.config.trainer import ActorConfig

pytestmark = pytest.mark.unit

# Qwen2.5-14B's config.json (the numbers the planner reads).
QWEN_14B = {
    "model_type": "qwen2", "hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 48,
    "num_attention_heads": 40, "num_key_value_heads": 8, "vocab_size": 152064, "tie_word_embeddings": False,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
}  # fmt: skip


def test_the_default_grows_with_each_ranks_share_of_the_checkpoint():
    one_rank = default_call_timeout_s(QWEN_14B, tp=1, pp=1)
    # 14.8e9 parameters x 16 bytes at 50 MiB/s on one rank: about 75 minutes more than the floor.
    assert one_rank - MIN_CALL_TIMEOUT_S == pytest.approx(14.8e9 * CHECKPOINT_BYTES_PER_PARAMETER
                                                          / SLOW_WRITE_BYTES_PER_S, rel=0.02)  # fmt: skip
    sharded = default_call_timeout_s(QWEN_14B, tp=8, pp=2)  # the largest rank: a stage with the embedding
    assert MIN_CALL_TIMEOUT_S < sharded < MIN_CALL_TIMEOUT_S + (one_rank - MIN_CALL_TIMEOUT_S) / 12


def test_the_setting_is_checked():
    with pytest.raises(ConfigError, match="call_timeout_s"):
        ActorConfig(call_timeout_s=0)
    with pytest.raises(ConfigError, match="call_timeout_s"):
        ActorConfig(call_timeout_s=float("inf"))
    assert ActorConfig(call_timeout_s=60).call_timeout_s == 60


def test_the_default_reads_a_model_directory_too(tmp_path):
    """``ActorSpec.architecture`` is often a HF directory (a pretrained model)."""
    import json

    (tmp_path / "config.json").write_text(json.dumps(QWEN_14B))
    assert default_call_timeout_s(tmp_path, tp=2, pp=1) == default_call_timeout_s(QWEN_14B, tp=2, pp=1)
    assert default_call_timeout_s(str(tmp_path / "config.json"), tp=2, pp=1) == default_call_timeout_s(QWEN_14B, tp=2, pp=1)
