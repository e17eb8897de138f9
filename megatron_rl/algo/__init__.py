"""Pure tensor math of the RL losses: advantages, token weights, the policy loss.

No Ray, Megatron or vLLM imports here (tests/unit/test_algo_imports.py checks it), so
the same functions serve the fused vocab-parallel op, the actor and the tests.
"""

from megatron_rl.algo.advantages import (
    UnknownEstimatorError,
    broadcast_to_tokens,
    compute_advantages,
    get_advantage_estimator,
    register_advantage,
    registered_advantages,
)
from megatron_rl.algo.config import (
    AdvantageConfig,
    AlgorithmConfig,
    ARConfig,
    LoptiConfig,
    STAPOConfig,
    TRGRPOConfig,
)
from megatron_rl.algo.policy_loss import (
    LossOutput,
    compute_policy_loss,
    finalize_metrics,
    kl_penalty,
    merge_metrics,
    ppo_clip_loss,
    prepare_advantages,
)
from megatron_rl.algo.token_weights import (
    advantage_reweight,
    lopti_split,
    stapo_candidates,
    stapo_entropy_threshold,
    stapo_spurious_mask,
    tr_grpo_weight,
)

__all__ = [
    "ARConfig",
    "AdvantageConfig",
    "AlgorithmConfig",
    "LoptiConfig",
    "LossOutput",
    "STAPOConfig",
    "TRGRPOConfig",
    "UnknownEstimatorError",
    "advantage_reweight",
    "broadcast_to_tokens",
    "compute_advantages",
    "compute_policy_loss",
    "finalize_metrics",
    "get_advantage_estimator",
    "kl_penalty",
    "lopti_split",
    "merge_metrics",
    "ppo_clip_loss",
    "prepare_advantages",
    "register_advantage",
    "registered_advantages",
    "stapo_candidates",
    "stapo_entropy_threshold",
    "stapo_spurious_mask",
    "tr_grpo_weight",
]
