"""The typed run config: one keyword-only dataclass per YAML section.

A run is described by :class:`RunConfig` (``model``, ``parallel``, ``rollout``,
``algorithm``, ``trainer``, ``actor``, ``data``, ``logging``). Read one with
:func:`load_run_config` (YAML plus dotted ``section.field=value`` overrides); the generic
machinery (type checks, "did you mean" errors, renamed fields, saving the resolved
config) lives in :mod:`megatron_rl.configlib`.

Conventions (``docs/style.md``): a docstring under every field (``docs/config.md`` is
generated from them), units and scope in names, checks of one section in its
``__post_init__`` with the path relative to the section, checks that span sections in
``RunConfig.__post_init__`` with the full path, and a ``ConfigWarning`` rather than an
error when a setting is legal but ignored. Each setting is declared once: where two
components need the same settings, one class declares them and the other extends it
(``TrainerConfig`` extends ``OptimConfig``, ``ModelConfig`` extends ``ModelOptions``,
``RolloutConfig`` and the engines' ``SamplingParams`` extend ``SamplingSettings``), and
components receive the sections themselves, never copies. Engine settings are not
re-declared: ``rollout.engine_args`` is handed to the engine unchanged.

Only the builder (``megatron_rl.builder``) reads a whole ``RunConfig``; components get
the sections they need. ``python -m megatron_rl.config`` prints the field reference
(``docs/config.md``).
"""

from megatron_rl.config.data import DataConfig, LoggingConfig
from megatron_rl.config.model import ModelConfig, ModelOptions, TinyModelConfig
from megatron_rl.config.parallel import ParallelConfig
from megatron_rl.config.rollout import PoolConfig, RolloutConfig, SamplingSettings
from megatron_rl.config.run import (
    DOCS_PATH,
    RunConfig,
    config_reference,
    load_run_config,
)
from megatron_rl.config.trainer import ActorConfig, OptimConfig, TrainerConfig

__all__ = [
    "DOCS_PATH",
    "ActorConfig",
    "DataConfig",
    "LoggingConfig",
    "ModelConfig",
    "ModelOptions",
    "OptimConfig",
    "ParallelConfig",
    "PoolConfig",
    "RolloutConfig",
    "RunConfig",
    "SamplingSettings",
    "TinyModelConfig",
    "TrainerConfig",
    "config_reference",
    "load_run_config",
]
