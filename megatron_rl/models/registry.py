"""Registry of HF <-> Megatron adapters, keyed by the HF config's ``model_type``.

Dispatch is by exact ``model_type`` (never by substrings of a model name). The
built-in architectures register themselves when ``megatron_rl.models`` is imported;
an extra architecture registers the same way, with no special case for built-ins.
:data:`ADAPTERS` is a :class:`~megatron_rl.config.lib.Registry`; an unknown name raises
:class:`UnknownModelTypeError`, which is both a :class:`ConversionError` and a
:class:`~megatron_rl.config.lib.UnknownNameError`.
"""

from __future__ import annotations

from typing import Any

from megatron_rl.config.lib import Registry, UnknownNameError
from megatron_rl.models.common import DecoderAdapter, config_dict
from megatron_rl.models.weight_units import ConversionError

__all__ = [
    "ADAPTERS",
    "UnknownModelTypeError",
    "register_adapter",
    "get_adapter",
    "adapter_for_config",
    "supported_model_types",
]


class UnknownModelTypeError(ConversionError, UnknownNameError):
    """No adapter is registered for the ``model_type``; the message lists the supported ones."""


ADAPTERS: Registry[DecoderAdapter] = Registry(
    "model type",
    unknown_error=UnknownModelTypeError,
    unknown_hint="(an adapter registers with megatron_rl.models.register_adapter)",
)
"""Adapters by HF ``model_type``."""


def register_adapter(adapter: DecoderAdapter) -> DecoderAdapter:
    """Register ``adapter`` under ``adapter.model_type``; a duplicate name raises ValueError."""
    return ADAPTERS.register(adapter.model_type, adapter)


def supported_model_types() -> list[str]:
    """Registered ``model_type`` names, sorted."""
    return ADAPTERS.names()


def get_adapter(model_type: str) -> DecoderAdapter:
    """The adapter for an HF ``model_type``; unknown types raise :class:`UnknownModelTypeError`
    (a :class:`ConversionError`) listing the supported ones."""
    if model_type not in ADAPTERS:
        # Worded for conversion, where the type comes from a checkpoint's config.json.
        raise UnknownModelTypeError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(supported_model_types())}"
        )
    return ADAPTERS.get(model_type)


def adapter_for_config(hf_config: Any) -> DecoderAdapter:
    """The adapter for an HF config (PretrainedConfig or config.json dict)."""
    model_type = config_dict(hf_config).get("model_type")
    if not model_type:
        raise ConversionError("HF config has no 'model_type' field")
    return get_adapter(model_type)
