"""Pure tensor math of the RL losses: advantages, token weights, the policy loss.

No Ray, Megatron or vLLM imports here (tests/unit/test_algo_imports.py checks it; the
package's import-graph test allows ``algo`` to import only ``algo`` and ``configlib``),
so the same functions serve the fused vocab-parallel op, the actor and the tests.
Token-weight methods are registered objects (``methods.py``) that the policy loss
composes; callers use the generic entry points and never name a method.
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
from megatron_rl.algo.methods import (
    TOKEN_WEIGHT_METHODS,
    PrepassTokens,
    TokenWeightMethod,
    needs_prepass,
    old_logp_before_forward,
    prepass_statistics,
    update_phases,
)
from megatron_rl.algo.mismatch import MismatchOutput, logprob_mismatch, truncated_is_weights
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
    "TOKEN_WEIGHT_METHODS",
    "ARConfig",
    "AdvantageConfig",
    "AlgorithmConfig",
    "LoptiConfig",
    "LossOutput",
    "MismatchOutput",
    "PrepassTokens",
    "STAPOConfig",
    "TRGRPOConfig",
    "TokenWeightMethod",
    "UnknownEstimatorError",
    "advantage_reweight",
    "broadcast_to_tokens",
    "compute_advantages",
    "compute_policy_loss",
    "finalize_metrics",
    "get_advantage_estimator",
    "kl_penalty",
    "logprob_mismatch",
    "lopti_split",
    "merge_metrics",
    "needs_prepass",
    "old_logp_before_forward",
    "ppo_clip_loss",
    "prepare_advantages",
    "prepass_statistics",
    "register_advantage",
    "registered_advantages",
    "stapo_candidates",
    "stapo_entropy_threshold",
    "stapo_spurious_mask",
    "tr_grpo_weight",
    "truncated_is_weights",
    "update_phases",
]
