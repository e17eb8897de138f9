"""Qwen3-MoE models (HF ``model_type`` "qwen3_moe", ``Qwen3MoeForCausalLM``).

Attention is Qwen3's (q/k RMSNorm, explicit ``head_dim``, no biases); every MLP is a
mixture of ``num_experts`` SwiGLU experts of width ``moe_intermediate_size``, each token
routed to ``num_experts_per_tok`` of them by a bias-free linear router (``mlp.gate``),
with no shared expert. :class:`~megatron_rl.models.moe.MoEDecoderAdapter` maps the router
(``norm_topk_prob``), the load-balancing coefficient and the sparse-layer layout, and
rejects what it cannot express. ``attention_bias=true`` would also put a bias on the
output projection, which Megatron's ``add_qkv_bias``-only layout cannot express.
"""

from megatron_rl.models.common import require_false, require_no_sliding_window
from megatron_rl.models.moe import MoEDecoderAdapter
from megatron_rl.models.registry import register_adapter

ADAPTER = register_adapter(
    MoEDecoderAdapter(
        model_type="qwen3_moe",
        architecture="Qwen3MoeForCausalLM",
        qk_norm=True,
        qkv_bias=lambda cfg: False,
        checks=(
            require_false("attention_bias", "it adds an o_proj bias Megatron's add_qkv_bias cannot express"),
            require_no_sliding_window,
            # Qwen2-MoE's field; Qwen3-MoE has no shared expert, and the units carry none.
            require_false("shared_expert_intermediate_size", "the qwen3_moe layout has no shared expert"),
        ),
    )
)
