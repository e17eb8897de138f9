"""Config errors and warnings, and the range/literal checks sections call in ``__post_init__``.

Checks that belong to one section raise :class:`ConfigError` naming the field *relative
to the section*; the loader prefixes the section's path, so a user sees the full dotted
path (``algorithm.ar.alpha``).
"""

from __future__ import annotations

import dataclasses
import math
import typing
import warnings
from collections.abc import Iterable
from types import MappingProxyType
from typing import Any, Literal

ALLOW_NONFINITE = MappingProxyType({"allow_nonfinite": True})
"""Field metadata of a float field that may hold ``inf`` or ``nan``
(``x: float = field(default=..., metadata=ALLOW_NONFINITE)``); every other float field
rejects them when a config is loaded (:func:`~megatron_rl.config.lib.from_dict`)."""

MAX_TIMEOUT_S = 86_400.0
"""Upper bound of every time limit in a config (a day). Longer is a typo, and the
``select``/``poll`` calls behind the waits overflow past about 2.1e6 s."""

MAX_SEED = 2**63 - 1
"""Largest ``trainer.seed``: seeds are 63-bit (``seeding.derive_seed``) and torch takes at
most 64 bits after the per-stage offsets are added."""


class ConfigError(ValueError):
    """A bad config value. ``path`` is the dotted field path (relative until prefixed)."""

    def __init__(self, path: str, message: str):
        self.path = path
        self.message = message
        super().__init__(f"config field '{path}': {message}" if path else message)

    def under(self, prefix: str) -> "ConfigError":
        """The same error with ``prefix`` prepended to its path."""
        if not prefix:
            return self
        return ConfigError(f"{prefix}.{self.path}" if self.path else prefix, self.message)


def require_in(path: str, value: Any, allowed: Iterable[Any]) -> None:
    """Raise unless ``value`` is one of ``allowed`` (the message lists them)."""
    allowed = list(allowed)
    if value not in allowed:
        raise ConfigError(path, f"got {value!r}; allowed values: {', '.join(repr(a) for a in allowed)}")


def require_range(
    path: str,
    value: float | int | None,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    allow_nonfinite: bool = False,
) -> None:
    """Raise unless ``value`` lies in the stated (half-)open interval. ``None`` passes.

    ``inf`` and ``nan`` are refused whatever the bounds (an unbounded side still means
    "any finite number"), unless ``allow_nonfinite`` says the field gives them a meaning.
    """
    if value is None:
        return
    if not allow_nonfinite and isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(path, f"got {value!r}; must be a finite number")
    bad = (
        (ge is not None and not value >= ge)
        or (gt is not None and not value > gt)
        or (le is not None and not value <= le)
        or (lt is not None and not value < lt)
    )
    if bad or value != value:  # NaN compares false with everything
        lo = f"[{ge}" if ge is not None else (f"({gt}" if gt is not None else "(-inf")
        hi = f"{le}]" if le is not None else (f"{lt})" if lt is not None else "inf)")
        raise ConfigError(path, f"got {value!r}; allowed range: {lo}, {hi}")


def check_literals(obj: Any) -> None:
    """Check every ``Literal[...]``-annotated field of dataclass ``obj`` holds an allowed value.

    Called from ``__post_init__`` so that configs built in Python (not only through the
    YAML loader) are validated the same way.
    """
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        tp = hints[f.name]
        allowed = _literal_values(tp)
        if allowed is not None:
            require_in(f.name, getattr(obj, f.name), allowed)


def _literal_values(tp: Any) -> list[Any] | None:
    """Allowed values of ``Literal[...]``, optionally in a union with ``None`` and/or ``bool``
    (``bool | Literal["auto"]``); ``None`` for any other annotation."""
    if typing.get_origin(tp) is Literal:
        return list(typing.get_args(tp))
    args = typing.get_args(tp)
    literals = [a for a in args if typing.get_origin(a) is Literal]
    rest = [a for a in args if typing.get_origin(a) is not Literal]
    if len(literals) != 1 or not rest or any(a not in (type(None), bool) for a in rest):
        return None
    return (
        list(typing.get_args(literals[0]))
        + ([True, False] if bool in rest else [])
        + ([None] if type(None) in rest else [])
    )


class ConfigWarning(UserWarning):
    """A legal setting that is ignored or unusual (e.g. a KL term together with STAPO).

    Like :class:`ConfigError`, ``path`` is relative to the section that warns, and
    :func:`from_dict` re-emits the warning with the full path.
    """

    def __init__(self, path: str, message: str):
        self.path = path
        self.message = message
        super().__init__(f"config field '{path}': {message}" if path else message)

    def under(self, prefix: str) -> "ConfigWarning":
        """The same warning with ``prefix`` prepended to its path."""
        if not prefix:
            return self
        return ConfigWarning(f"{prefix}.{self.path}" if self.path else prefix, self.message)


class ConfigRenameWarning(FutureWarning):
    """A field was given by its old name (see ``schema.renamed_fields``); the value is used
    under the new name. A ``FutureWarning``: shown to users, and not an error where config
    warnings are."""

    def __init__(self, path: str, new_path: str):
        self.path = path
        self.new_path = new_path
        self.message = f"is renamed; write '{new_path}'"
        super().__init__(f"config field '{path}': {self.message}")


def warn_config(path: str, message: str) -> None:
    """Warn about field ``path`` (relative to the section); use for ignored settings."""
    warnings.warn(ConfigWarning(path, message), stacklevel=3)
