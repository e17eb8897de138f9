"""Llama 2 / 3.x (HF ``model_type`` "llama").

The reference layout of the family: no biases, no q/k norm. Llama 3.1+ frequency
scaling (``rope_type: llama3``) maps onto GPTModel's ``rope_scaling``; megatron-core
hard-codes its low/high frequency factors (1, 4) and original context (8192), which
is what the released configs use. ``attention_bias`` / ``mlp_bias`` would need biases
on every projection and are rejected.
"""

from megatron_rl.models.common import DecoderAdapter, require_false
from megatron_rl.models.registry import register_adapter

ADAPTER = register_adapter(
    DecoderAdapter(
        model_type="llama",
        architecture="LlamaForCausalLM",
        qk_norm=False,
        qkv_bias=lambda cfg: False,
        checks=(
            require_false("attention_bias", "it adds an o_proj bias Megatron's add_qkv_bias cannot express"),
            require_false("mlp_bias", "MLP biases are not mapped"),
        ),
    )
)
