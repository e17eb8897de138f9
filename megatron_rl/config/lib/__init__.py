"""Machinery shared by every typed config in megatron_rl, and the generic registry.

Configs are keyword-only dataclasses with a docstring under each field. Checks that
belong to one section live in that section's ``__post_init__`` and raise
:class:`ConfigError` naming the field *relative to the section*; the loader prefixes
the section's path, so a user sees the full dotted path (``algorithm.ar.alpha``).

This package knows nothing about any particular section:

- ``errors``: :class:`ConfigError`, :class:`ConfigWarning` and the checks sections call
  (ranges refuse ``inf``/``nan`` unless a field allows them; shared upper limits);
- ``yaml_io``: YAML reading (bounded: no alias bombs) and dotted ``a.b.c=value`` overrides;
- ``schema``: :func:`from_dict` (types, unknown keys with a "did you mean", renamed
  fields) and :func:`to_dict`;
- ``loading``: :func:`load_config` (file + overrides, errors naming file and line) and
  :func:`save_resolved` (the run directory's ``config.yaml``);
- ``docs``: the field reference generated from the docstrings (``docs/config.md``);
- ``registry``: :class:`Registry`, the one small name -> object registry behind every
  extension point (advantage estimators, token-weight methods, rewards, tasks, model
  adapters).

It imports neither torch nor anything else heavy, so config errors and ``--help`` stay fast.
"""

from megatron_rl.config.lib.docs import field_docs, iter_sections, render_docs
from megatron_rl.config.lib.errors import (
    ALLOW_NONFINITE,
    MAX_SEED,
    MAX_TIMEOUT_S,
    ConfigError,
    ConfigRenameWarning,
    ConfigWarning,
    check_literals,
    require_in,
    require_range,
    warn_config,
)
from megatron_rl.config.lib.loading import dump_yaml, load_config, save_resolved
from megatron_rl.config.lib.registry import Registry, UnknownNameError
from megatron_rl.config.lib.schema import (
    from_dict,
    renamed_fields,
    section_type,
    to_dict,
    type_label,
)
from megatron_rl.config.lib.yaml_io import (
    apply_overrides,
    parse_override_value,
    parse_yaml,
)

__all__ = [
    "ALLOW_NONFINITE",
    "MAX_SEED",
    "MAX_TIMEOUT_S",
    "ConfigError",
    "ConfigRenameWarning",
    "ConfigWarning",
    "Registry",
    "UnknownNameError",
    "apply_overrides",
    "check_literals",
    "dump_yaml",
    "field_docs",
    "from_dict",
    "iter_sections",
    "load_config",
    "parse_override_value",
    "parse_yaml",
    "render_docs",
    "renamed_fields",
    "require_in",
    "require_range",
    "save_resolved",
    "section_type",
    "to_dict",
    "type_label",
    "warn_config",
]
