"""Qwen2 and Qwen2.5 (HF ``model_type`` "qwen2").

Differences from the Llama layout: q/k/v projections always carry biases (the output
projection and the MLP do not), which Megatron expresses as ``add_qkv_bias=True`` with
``add_bias_linear=False``. Sliding-window attention is off in every released Qwen2.5
config and is rejected if switched on.
"""

from megatron_rl.models.common import DecoderAdapter, require_no_sliding_window
from megatron_rl.models.registry import register_adapter

ADAPTER = register_adapter(
    DecoderAdapter(
        model_type="qwen2",
        architecture="Qwen2ForCausalLM",
        qk_norm=False,
        qkv_bias=lambda cfg: True,
        checks=(require_no_sliding_window,),
    )
)
