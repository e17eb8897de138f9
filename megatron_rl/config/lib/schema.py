"""Building typed config trees from plain data and back: type checks, unknown keys, renames.

:func:`from_dict` builds a keyword-only dataclass (and its nested sections) from YAML
data, checking types and rejecting unknown keys with a "did you mean" suggestion;
:func:`to_dict` goes back to plain data.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import types
import typing
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, TypeVar

from megatron_rl.config.lib.errors import ConfigError, ConfigRenameWarning, ConfigWarning

T = TypeVar("T")


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    # Modules use ``from __future__ import annotations``: annotations are strings until resolved.
    return typing.get_type_hints(cls)


def section_type(tp: Any) -> type | None:
    """The dataclass in ``tp`` if ``tp`` is a section (``X`` or ``X | None``), else ``None``."""
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return tp
    if _is_union(tp):
        arms = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(arms) == 1 and dataclasses.is_dataclass(arms[0]):
            return arms[0]
    return None


def type_label(tp: Any) -> str:
    """A short human name of annotation ``tp`` (``float | null``, ``'hf' | 'vllm'``, ``list[str]``)."""
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if _is_union(tp):
        return " | ".join(type_label(a) for a in args)
    if origin is not None:  # list[...], dict[...], ...
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(type_label(a) for a in args)}]" if args else name
    if dataclasses.is_dataclass(tp):
        return f"a mapping (section {tp.__name__})"
    return getattr(tp, "__name__", str(tp))


def _type_error(path: str, value: Any, tp: Any) -> ConfigError:
    message = f"expected {type_label(tp)}, got {value!r} ({type(value).__name__})"
    if tp is str and isinstance(value, (int, float, bool)):
        message += "; quote it in YAML to pass a string"
    return ConfigError(path, message)


def _nonfinite_error(path: str, value: Any) -> ConfigError:
    shown = repr(value) if isinstance(value, float) else f"an integer of {len(str(value))} digits"
    return ConfigError(path, f"got {shown}; must be a finite number")


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _convert(tp: Any, value: Any, path: str, allow_nonfinite: bool = False) -> Any:
    """``value`` checked (and, int -> float only, converted) against annotation ``tp``.

    A float must be finite (YAML reads ``.inf`` and ``.nan``) unless ``allow_nonfinite``
    (the field's :data:`~megatron_rl.config.lib.ALLOW_NONFINITE` metadata): one check for
    every float field, whether or not its section states a range.
    """
    if tp is Any:
        return value
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        # ``True == 1`` in Python, so compare types as well as values.
        if not any(value == a and type(value) is type(a) for a in args):
            raise ConfigError(path, f"got {value!r}; allowed values: {', '.join(repr(a) for a in args)}")
        return value
    if _is_union(tp):
        if value is None:
            if type(None) in args:
                return None
            raise _type_error(path, value, tp)
        arms = [a for a in args if a is not type(None)]
        if len(arms) == 1 and arms[0] not in (int, float, str, bool):
            # Optional[section | list | Literal]: X's own error names the precise field/values.
            return _convert(arms[0], value, path, allow_nonfinite)
        if float in arms and int not in arms and isinstance(value, (int, float)) and not isinstance(value, bool):
            return _convert(float, value, path, allow_nonfinite)  # its own error (e.g. not finite) stands
        for arm in arms:
            try:
                return _convert(arm, value, path, allow_nonfinite)
            except ConfigError:
                continue
        raise _type_error(path, value, tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path)
    if origin in (list, Sequence) or tp is list:
        if not isinstance(value, (list, tuple)):
            raise _type_error(path, value, tp)
        item_tp = args[0] if args else Any
        return [_convert(item_tp, v, f"{path}[{i}]", allow_nonfinite) for i, v in enumerate(value)]
    if origin in (dict, Mapping) or tp is dict:
        if not isinstance(value, Mapping):
            raise _type_error(path, value, tp)
        key_tp, val_tp = args if args else (Any, Any)
        out = {}
        for k, v in value.items():
            out[_convert(key_tp, k, f"{path}.{k}")] = _convert(val_tp, v, f"{path}.{k}", allow_nonfinite)
        return out
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _type_error(path, value, tp)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _type_error(path, value, tp)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                value = float(value)
            except OverflowError:  # an int beyond float range (YAML ints are unbounded)
                raise _nonfinite_error(path, value) from None
            if not allow_nonfinite and not math.isfinite(value):
                raise _nonfinite_error(path, value)
            return value
        raise _type_error(path, value, tp)
    if isinstance(tp, type) and not isinstance(value, tp):
        raise _type_error(path, value, tp)
    return value


def _unknown_field_message(name: str, section_path: str, valid: Iterable[str]) -> str:
    valid = list(valid)
    where = f"section '{section_path}'" if section_path else "the top level"
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return f"unknown field in {where}; {hint}valid fields: {', '.join(valid)}"


def renamed_fields(**old_to_new: str) -> Callable[[type[T]], type[T]]:
    """Class decorator: a section still accepts the old names of renamed fields.

    ``@renamed_fields(reward="task")`` lets a YAML file or an override write ``reward``;
    the value goes to ``task`` with a :class:`ConfigWarning` saying so, both names at
    once are an error, and errors about the value name the key the user wrote.
    """

    def wrap(cls: type[T]) -> type[T]:
        cls.__config_renamed__ = dict(old_to_new)  # type: ignore[attr-defined]
        return cls

    return wrap


def _renames(cls: type) -> dict[str, str]:
    return dict(getattr(cls, "__config_renamed__", {}))


def canonical_key(cls: type, dotted: str) -> str:
    """``dotted`` (an override key) with every renamed field replaced by its current name.

    Emits one :class:`ConfigWarning` per old name used. Parts that are not fields are
    kept as they are (``from_dict`` reports them as unknown).
    """
    parts, out, tp = dotted.split("."), [], cls
    for part in parts:
        section = section_type(tp) if tp is not None else None
        if section is not None:
            new = _renames(section).get(part)
            if new is not None:
                old_path = ".".join(out + [part])
                warnings.warn(ConfigRenameWarning(old_path, ".".join(out + [new])), stacklevel=3)
                part = new
            tp = _type_hints(section).get(part)
        else:
            tp = None
        out.append(part)
    return ".".join(out)


def _apply_renames(cls: type, data: Mapping[str, Any], path: str) -> tuple[dict[str, Any], dict[str, str]]:
    """A copy of one section's ``data`` with old field names replaced (one warning each), and
    ``{current name: old name}`` for those the data used; both names at once is an error."""
    out, written_as = dict(data), {}
    for old, new in _renames(cls).items():
        if old in out:
            if new in out:
                raise ConfigError(_join(path, old), f"set only one of '{_join(path, new)}' and its old name")
            warnings.warn(ConfigRenameWarning(_join(path, old), _join(path, new)), stacklevel=4)
            out[new] = out.pop(old)
            written_as[new] = old
    return out, written_as


def canonical_data(cls: type, data: Any, path: str = "", written_as: dict[str, str] | None = None) -> Any:
    """A copy of raw config ``data`` with the old names of renamed fields replaced, recursively.

    ``written_as`` (if given) collects ``{current dotted path: old dotted path}`` so errors
    can name the key the user wrote; one :class:`ConfigWarning` is emitted per old name.
    """
    section = section_type(cls)
    if section is None or not isinstance(data, Mapping):
        return data
    out, renamed = _apply_renames(section, data, path)
    if written_as is not None:
        written_as.update({_join(path, new): _join(path, old) for new, old in renamed.items()})
    hints = _type_hints(section)
    for key, value in out.items():
        if isinstance(key, str) and key in hints:
            out[key] = canonical_data(hints[key], value, _join(path, key), written_as)
    return out


def from_dict(cls: type[T], data: Any, path: str = "") -> T:
    """Build keyword-only dataclass ``cls`` (and its nested sections) from plain YAML data.

    Every error is a :class:`ConfigError` carrying the full dotted path: unknown keys
    (with the closest valid name), wrong types (value and expected type), and the
    section's own ``__post_init__`` checks (their relative path prefixed with ``path``).
    Old names of renamed fields (:func:`renamed_fields`) are accepted with a warning.
    """
    if not (dataclasses.is_dataclass(cls) and isinstance(cls, type)):
        raise TypeError(f"from_dict needs a dataclass type, got {cls!r}")
    if not isinstance(data, Mapping):
        raise ConfigError(
            path, f"expected a mapping of fields (section {cls.__name__}), got {data!r} ({type(data).__name__})"
        )
    hints = _type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    data, written_as = _apply_renames(cls, data, path)  # written_as: current name -> the old one used
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if not isinstance(key, str) or key not in fields:
            raise ConfigError(_join(path, str(key)), _unknown_field_message(str(key), path, fields))
        allow_nonfinite = bool(fields[key].metadata.get("allow_nonfinite", False))
        kwargs[key] = _convert(hints[key], value, _join(path, written_as.get(key, key)), allow_nonfinite)
    for name, f in fields.items():
        if name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(_join(path, name), "required field is missing")
    # Warnings from __post_init__ name fields relative to the section, like its errors do:
    # catch them and re-emit them with the full path. (catch_warnings is process-global;
    # configs are loaded from one thread.)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConfigWarning)
        try:
            obj = cls(**kwargs)
        except ConfigError as e:
            head, dot, rest = e.path.partition(".")
            if head in written_as:
                e = ConfigError(written_as[head] + dot + rest, e.message)
            raise e.under(path) from None
    for w in caught:
        if isinstance(w.message, ConfigWarning):
            warnings.warn(w.message.under(path), stacklevel=2)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    return obj


def to_dict(obj: Any) -> Any:
    """Plain YAML-able data of a config tree (like ``dataclasses.asdict``; tuples -> lists)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
    if isinstance(obj, Mapping):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    return obj
