"""HF <-> Megatron model adapters: one small package per architecture, dispatched by ``model_type``.

Importing this package registers the built-in architectures (qwen2 -- which covers
Qwen2.5 --, qwen3, llama, and the mixture-of-experts qwen3_moe). It imports torch but
not megatron-core or transformers.
"""

from megatron_rl.models.common import DecoderAdapter, ModelDims, padded_vocab_size
from megatron_rl.models.registry import adapter_for_config, get_adapter, register_adapter, supported_model_types
from megatron_rl.models.weight_units import ConversionError, WeightUnit, canonical_mcore_name, index_by_mcore_name

# Registration happens on import of each architecture package.
from megatron_rl.models import llama, qwen2, qwen3, qwen3_moe  # noqa: E402,F401  isort: skip

__all__ = [
    "ConversionError",
    "DecoderAdapter",
    "ModelDims",
    "WeightUnit",
    "adapter_for_config",
    "canonical_mcore_name",
    "get_adapter",
    "index_by_mcore_name",
    "padded_vocab_size",
    "register_adapter",
    "supported_model_types",
]
