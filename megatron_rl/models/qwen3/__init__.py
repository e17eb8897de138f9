"""Qwen3 dense models (HF ``model_type`` "qwen3").

Differences from the Llama layout: per-head RMSNorm on queries and keys before RoPE
(``self_attn.q_norm`` / ``k_norm``, shape ``[head_dim]``), which is Megatron's
``qk_layernorm=True``; ``head_dim`` is explicit and need not equal hidden / heads.
``attention_bias=True`` would also put a bias on the output projection, which the
``add_qkv_bias``-only Megatron layout cannot express, so it is rejected.
"""

from megatron_rl.models.common import DecoderAdapter, require_false, require_no_sliding_window
from megatron_rl.models.registry import register_adapter

ADAPTER = register_adapter(
    DecoderAdapter(
        model_type="qwen3",
        architecture="Qwen3ForCausalLM",
        qk_norm=True,
        qkv_bias=lambda cfg: False,
        checks=(
            require_false("attention_bias", "it adds an o_proj bias Megatron's add_qkv_bias cannot express"),
            require_no_sliding_window,
        ),
    )
)
