"""Pure tensor math of the RL losses: advantages, token weights, the policy loss.

No Ray, Megatron or vLLM imports here (tests/unit/test_algo_imports.py checks it; the
package's import-graph test allows ``algo`` to import only ``algo`` and ``config.lib``),
so the same functions serve the fused vocab-parallel op, the actor and the tests.
Token-weight methods are registered objects, one file each (``methods/``), that the
policy loss composes (``methods/compose.py``); callers use the generic entry points and
never name a method.
"""

from megatron_rl.algo.advantages import (
    UnknownEstimatorError,
    broadcast_to_tokens,
    compute_advantages,
    get_advantage_estimator,
    register_advantage,
    registered_advantages,
)
from megatron_rl.algo.config import AdvantageConfig, AlgorithmConfig
from megatron_rl.algo.methods.ar import ARConfig, advantage_reweight
from megatron_rl.algo.methods.base import TOKEN_WEIGHT_METHODS, PrepassTokens, TokenWeightMethod
from megatron_rl.algo.methods.compose import needs_prepass, old_logp_before_forward, prepass_statistics, update_phases
from megatron_rl.algo.methods.lopti import LoptiConfig, lopti_split
from megatron_rl.algo.methods.stapo import (
    STAPOConfig,
    stapo_candidates,
    stapo_entropy_threshold,
    stapo_spurious_mask,
)
from megatron_rl.algo.methods.tr_grpo import TRGRPOConfig, tr_grpo_weight
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
