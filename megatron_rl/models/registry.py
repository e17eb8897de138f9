"""Registry of HF <-> Megatron adapters, keyed by the HF config's ``model_type``.

Dispatch is by exact ``model_type`` (never by substrings of a model name). The
built-in architectures register themselves when ``megatron_rl.models`` is imported;
an extra architecture registers the same way, with no special case for built-ins.
"""

from __future__ import annotations

from typing import Any

from megatron_rl.models.common import ConversionError, DecoderAdapter, config_dict

__all__ = ["register_adapter", "get_adapter", "adapter_for_config", "supported_model_types"]

_ADAPTERS: dict[str, DecoderAdapter] = {}


def register_adapter(adapter: DecoderAdapter) -> DecoderAdapter:
    """Register ``adapter`` under ``adapter.model_type``; a duplicate name raises ValueError."""
    if adapter.model_type in _ADAPTERS:
        raise ValueError(f"an adapter for model_type '{adapter.model_type}' is already registered")
    _ADAPTERS[adapter.model_type] = adapter
    return adapter


def supported_model_types() -> list[str]:
    """Registered ``model_type`` names, sorted."""
    return sorted(_ADAPTERS)


def get_adapter(model_type: str) -> DecoderAdapter:
    """The adapter for an HF ``model_type``; unknown types raise ConversionError listing the supported ones."""
    try:
        return _ADAPTERS[model_type]
    except KeyError:
        raise ConversionError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(supported_model_types())}"
        ) from None


def adapter_for_config(hf_config: Any) -> DecoderAdapter:
    """The adapter for an HF config (PretrainedConfig or config.json dict)."""
    model_type = config_dict(hf_config).get("model_type")
    if not model_type:
        raise ConversionError("HF config has no 'model_type' field")
    return get_adapter(model_type)
