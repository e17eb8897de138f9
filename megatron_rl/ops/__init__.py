"""Fused vocab-parallel ops: log-probs, entropy and the token-weighted policy loss in one
pass over TP-sharded logits (or hidden states and the lm-head shard)."""

from megatron_rl.ops.fused_policy_loss import (
    LossInputs,
    VocabParallelOptions,
    fused_linear_policy_loss,
    fused_policy_loss,
    vocab_parallel_logprobs,
    vocab_parallel_logprobs_from_hidden,
)
from megatron_rl.ops.vocab_parallel import SoftmaxStats

__all__ = [
    "LossInputs",
    "SoftmaxStats",
    "VocabParallelOptions",
    "fused_linear_policy_loss",
    "fused_policy_loss",
    "vocab_parallel_logprobs",
    "vocab_parallel_logprobs_from_hidden",
]
