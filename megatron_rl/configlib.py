"""Machinery shared by every typed config in megatron_rl.

Configs are keyword-only dataclasses with a docstring under each field. Checks that
belong to one section live in that section's ``__post_init__`` and raise
:class:`ConfigError` naming the field *relative to the section*; the loader prefixes
the section's path, so a user sees the full dotted path (``algorithm.ar.alpha``).

The generic half of the config system also lives here and knows nothing about any
particular section:

- :func:`load_config` reads a YAML file, applies dotted ``a.b.c=value`` overrides
  (:func:`apply_overrides`) and builds the dataclass tree with :func:`from_dict`, which
  checks types and rejects unknown keys with a "did you mean" suggestion.
- :func:`to_dict` / :func:`save_resolved` write the resolved config into the run directory
  so that a run can be reproduced from its own output.
- :func:`field_docs` reads the docstring under each field from the source, so the field
  reference (``docs/config.md``, :func:`render_docs`) cannot drift from the code.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import difflib
import functools
import inspect
import os
import re
import tempfile
import textwrap
import types
import typing
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

T = TypeVar("T")


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
) -> None:
    """Raise unless ``value`` lies in the stated (half-)open interval. ``None`` passes."""
    if value is None:
        return
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
    """Allowed values of ``Literal[...]`` or ``Optional[Literal[...]]``; ``None`` otherwise."""
    if typing.get_origin(tp) is Literal:
        return list(typing.get_args(tp))
    args = typing.get_args(tp)
    if args and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1 and typing.get_origin(inner[0]) is Literal:
            return list(typing.get_args(inner[0])) + [None]
    return None


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


def warn_config(path: str, message: str) -> None:
    """Warn about field ``path`` (relative to the section); use for ignored settings."""
    warnings.warn(ConfigWarning(path, message), stacklevel=3)


# --------------------------------------------------------------------------- YAML


# PyYAML implements YAML 1.1, whose float pattern needs a dot (``1.0e-6``), so ``lr: 1e-6``
# would arrive as the STRING '1e-6'. YAML 1.2 and every reader expect a number.
_EXP_FLOAT_RE = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")


class _YamlLoader(yaml.SafeLoader):
    """``SafeLoader`` that reads ``1e-6`` as a float and rejects duplicate keys.

    PyYAML silently keeps the last of two equal keys, which hides the first setting.
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[str, yaml.Mark] = {}
        for key_node, _ in node.value:
            # Keys pulled in by a merge (``<<: *base``) may legitimately be overridden.
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                if key_node.value in seen:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping",
                        node.start_mark,
                        f"found duplicate key {key_node.value!r} "
                        f"(first set on line {seen[key_node.value].line + 1})",
                        key_node.start_mark,
                    )
                seen[key_node.value] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


_YamlLoader.add_implicit_resolver("tag:yaml.org,2002:float", _EXP_FLOAT_RE, list("-+0123456789."))


def parse_yaml(text: str, source: str = "<string>") -> Any:
    """Parse YAML ``text``; a syntax error becomes a :class:`ConfigError` naming ``source`` and line."""
    try:
        return yaml.load(text, Loader=_YamlLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{source}, line {mark.line + 1}, column {mark.column + 1}" if mark else source
        problem = getattr(e, "problem", None) or str(e)
        context = getattr(e, "context", None)
        detail = f"{context}: {problem}" if context else problem
        raise ConfigError("", f"YAML syntax error in {where}: {detail}") from None


def parse_override_value(text: str) -> Any:
    """The value of one ``key=value`` override, read as YAML (``1e-6``, ``true``, ``null``, ``[1,2]``).

    An empty value is the empty string. Text that is not valid YAML (``*.jsonl`` reads as
    an alias) is kept as a string; the field's type check still applies to it.
    """
    if not text.strip():
        return ""
    try:
        return yaml.load(text, Loader=_YamlLoader)
    except yaml.YAMLError:
        return text


def apply_overrides(data: Mapping[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """A copy of raw config ``data`` with dotted ``a.b.c=value`` overrides applied in order.

    Missing (or null) intermediate sections are created, so that a misspelt key reaches
    :func:`from_dict` and gets its "did you mean" error there, in one place.
    """
    result: dict[str, Any] = copy.deepcopy(dict(data))
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError("", f"malformed override {item!r}: expected KEY=VALUE with a dotted key, e.g. trainer.lr=1e-6")
        parts = key.split(".")
        if not all(parts):
            raise ConfigError("", f"malformed override {item!r}: empty name in dotted key {key!r}")
        node = result
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise ConfigError(
                    ".".join(parts[: i + 1]), f"cannot apply override {item!r}: the field holds {child!r}, not a section"
                )
            node = child
        node[parts[-1]] = parse_override_value(raw)
    return result


# --------------------------------------------------------------------------- types


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


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _convert(tp: Any, value: Any, path: str) -> Any:
    """``value`` checked (and, int -> float only, converted) against annotation ``tp``."""
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
            return _convert(arms[0], value, path)
        for arm in arms:
            try:
                return _convert(arm, value, path)
            except ConfigError:
                continue
        raise _type_error(path, value, tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path)
    if origin in (list, Sequence) or tp is list:
        if not isinstance(value, (list, tuple)):
            raise _type_error(path, value, tp)
        item_tp = args[0] if args else Any
        return [_convert(item_tp, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin in (dict, Mapping) or tp is dict:
        if not isinstance(value, Mapping):
            raise _type_error(path, value, tp)
        key_tp, val_tp = args if args else (Any, Any)
        out = {}
        for k, v in value.items():
            out[_convert(key_tp, k, f"{path}.{k}")] = _convert(val_tp, v, f"{path}.{k}")
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
            return float(value)
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


def from_dict(cls: type[T], data: Any, path: str = "") -> T:
    """Build keyword-only dataclass ``cls`` (and its nested sections) from plain YAML data.

    Every error is a :class:`ConfigError` carrying the full dotted path: unknown keys
    (with the closest valid name), wrong types (value and expected type), and the
    section's own ``__post_init__`` checks (their relative path prefixed with ``path``).
    """
    if not (dataclasses.is_dataclass(cls) and isinstance(cls, type)):
        raise TypeError(f"from_dict needs a dataclass type, got {cls!r}")
    if not isinstance(data, Mapping):
        raise ConfigError(
            path, f"expected a mapping of fields (section {cls.__name__}), got {data!r} ({type(data).__name__})"
        )
    hints = _type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if not isinstance(key, str) or key not in fields:
            raise ConfigError(_join(path, str(key)), _unknown_field_message(str(key), path, fields))
        kwargs[key] = _convert(hints[key], value, _join(path, key))
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


def dump_yaml(config: Any) -> str:
    """The config tree as YAML text, fields in declaration order."""
    return yaml.safe_dump(to_dict(config), sort_keys=False, default_flow_style=False, allow_unicode=True)


def save_resolved(config: Any, run_dir: str | os.PathLike[str], filename: str = "config.yaml") -> Path:
    """Write the resolved ``config`` to ``run_dir/filename`` atomically; returns the path.

    The text goes to a temporary file in the same directory, then ``os.replace`` swaps it
    in, so a reader (or a crash) never sees a half-written config.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    target = run_dir / filename
    fd, tmp = tempfile.mkstemp(dir=run_dir, prefix=f".{filename}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(dump_yaml(config))
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; the config is not secret
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return target


def _split_path(dotted: str) -> list[str | int]:
    """``data.train_files[0]`` -> ``['data', 'train_files', 0]``."""
    return [int(p[1:-1]) if p.startswith("[") else p for p in re.findall(r"\[\d+\]|[^.\[\]]+", dotted)]


def _yaml_line(text: str, dotted: str) -> int | None:
    """1-based line of the deepest part of ``dotted`` present in YAML ``text`` (None if none)."""
    try:
        node = yaml.compose(text, Loader=_YamlLoader)
    except yaml.YAMLError:
        return None
    line = None
    for part in _split_path(dotted):
        if isinstance(node, yaml.MappingNode) and isinstance(part, str):
            for key_node, value_node in node.value:
                if isinstance(key_node, yaml.ScalarNode) and key_node.value == part:
                    line, node = key_node.start_mark.line + 1, value_node
                    break
            else:
                break
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            break
    return line


def _error_source(path: str, text: str, overrides: Sequence[str], source: str) -> str | None:
    """Where the value behind error ``path`` came from: the last override setting it, or a file line."""
    for item in reversed(overrides):
        key = item.partition("=")[0].strip()
        if path == key or path.startswith((key + ".", key + "[")):
            return f"set by override {item!r}"
    line = _yaml_line(text, path) if path else None
    return f"{source}, line {line}" if line else None


def load_config(cls: type[T], yaml_path: str | os.PathLike[str], overrides: Iterable[str] = ()) -> T:
    """Read ``yaml_path``, apply dotted ``overrides`` and build ``cls``; errors name file and line."""
    path = Path(yaml_path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError("", f"config file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError("", f"cannot read config file {path}: {e}") from None
    data = parse_yaml(text, source=str(path))
    if data is None:
        raise ConfigError("", f"config file {path} is empty; expected a mapping of config sections")
    if not isinstance(data, Mapping):
        raise ConfigError(
            "", f"config file {path}: the top level must be a mapping of config sections, got {type(data).__name__}"
        )
    overrides = list(overrides)
    data = apply_overrides(data, overrides)
    try:
        return from_dict(cls, data)
    except ConfigError as e:
        where = _error_source(e.path, text, overrides, str(path))
        if where is None:
            raise
        raise ConfigError(e.path, f"{e.message} ({where})") from None


# --------------------------------------------------------------------------- field docs


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of dataclass ``cls`` (``''`` where there is none).

    Python keeps no such docstrings at runtime, so they are read from the class source
    with ``ast``: a string-literal statement right after an annotated assignment.
    """
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):  # base classes first, so subclasses override
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):  # defined interactively: no source to read
            continue
        class_def = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef))
        for stmt, nxt in zip(class_def.body, class_def.body[1:]):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[stmt.target.id] = inspect.cleandoc(nxt.value.value)
    return {f.name: docs.get(f.name, "") for f in dataclasses.fields(cls)}


def iter_sections(cls: type, path: str = "") -> Iterator[tuple[str, type]]:
    """``(dotted path, dataclass)`` of ``cls`` and every section nested in it, depth first."""
    yield path, cls
    hints = _type_hints(cls)
    for f in dataclasses.fields(cls):
        sub = section_type(hints[f.name])
        if sub is not None:
            yield from iter_sections(sub, _join(path, f.name))


def _inline_yaml(value: Any) -> str:
    text = yaml.safe_dump(to_dict(value), default_flow_style=True, width=10_000).strip()
    return text[: -len("...")].strip() if text.endswith("\n...") else text


def render_docs(cls: type, *, title: str, intro: str = "", regenerate: str = "") -> str:
    """A Markdown reference of every section and field of config ``cls``, from the docstrings."""
    lines = [f"# {title}", ""]
    if regenerate:
        lines += [f"<!-- Generated from the field docstrings by `{regenerate}`; edit those, not this file. -->", ""]
    if intro:
        lines += [intro.strip(), ""]
    for path, section in iter_sections(cls):
        hints, docs = _type_hints(section), field_docs(section)
        lines += [f"## `{path}`" if path else "## Top level", ""]
        if section.__doc__:
            lines += [inspect.cleandoc(section.__doc__), ""]
        for f in dataclasses.fields(section):
            tp = hints[f.name]
            sub = section_type(tp)
            if sub is not None:
                label = "section" + (" | null" if _is_union(tp) else "")
                see = f"see `{_join(path, f.name)}`"
                default = f"; default `null`, {see}" if f.default is None else f"; {see}"
            else:
                label = type_label(tp)
                if f.default is not dataclasses.MISSING:
                    default = f"; default `{_inline_yaml(f.default)}`"
                elif f.default_factory is not dataclasses.MISSING:
                    default = f"; default `{_inline_yaml(f.default_factory())}`"
                else:
                    default = "; required"
            lines.append(f"- **`{f.name}`** (`{label}`{default})")
            doc = docs.get(f.name, "")
            lines += [f"  {line}".rstrip() for line in doc.splitlines()]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
