"""YAML reading (numbers as YAML 1.2 reads them, duplicate keys rejected, size bounded) and
dotted overrides.

Anchors and aliases are legal YAML, and a short text can nest them into billions of
values (an "alias bomb": 1.5 KB took minutes and gigabytes to load and to save again
as the resolved config). So the node graph is composed first, with aliases still shared,
and its expanded size counted before anything is constructed: more than
:data:`MAX_CONFIG_VALUES` values, or a recursive alias, is a :class:`ConfigError`.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Mapping
from typing import Any

import yaml

from megatron_rl.config.lib.errors import ConfigError

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
                        f"found duplicate key {key_node.value!r} (first set on line {seen[key_node.value].line + 1})",
                        key_node.start_mark,
                    )
                seen[key_node.value] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


_YamlLoader.add_implicit_resolver("tag:yaml.org,2002:float", _EXP_FLOAT_RE, list("-+0123456789."))

MAX_CONFIG_BYTES = 1 << 20
"""Largest config text read (1 MiB; a real run config is a few KB)."""

MAX_CONFIG_VALUES = 100_000
"""Most values (scalars, lists and mappings, aliases counted as often as they are used)
one config may expand to; a real run config has a few hundred."""


def _expanded_size(root: yaml.Node, source: str) -> int:
    """Values ``root`` expands to (aliases counted at every use), without expanding it.

    Shared nodes are counted once each and multiplied by their uses (memoised by node), so
    this is linear in the composed text however deep the aliases nest.
    """
    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            on_path.discard(key)
            total = 1 + sum(sizes[id(c)] for c in _children(node))
            if total > MAX_CONFIG_VALUES:
                raise ConfigError(
                    "",
                    f"{source}: the YAML expands to more than {MAX_CONFIG_VALUES} values (anchors and aliases "
                    f"nested inside each other?), near line {node.start_mark.line + 1}",
                )
            sizes[key] = total
            continue
        if key in sizes:
            continue
        if key in on_path:
            raise ConfigError("", f"{source}: recursive YAML alias near line {node.start_mark.line + 1}")
        on_path.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in _children(node) if id(c) not in sizes)
    return sizes[id(root)]


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def _load_bounded(text: str, source: str) -> Any:
    """``yaml.load`` with :class:`_YamlLoader`, refusing texts that are or expand too large."""
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError("", f"{source}: {len(text)} characters of YAML; a config may hold at most {MAX_CONFIG_BYTES}")
    loader = _YamlLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _expanded_size(node, source)
        return loader.construct_document(node)
    except RecursionError:  # PyYAML composes and constructs recursively
        raise ConfigError("", f"{source}: the YAML is nested too deeply") from None
    finally:
        loader.dispose()


def parse_yaml(text: str, source: str = "<string>") -> Any:
    """Parse YAML ``text``; a syntax error becomes a :class:`ConfigError` naming ``source`` and line,
    and so does a text that is, or expands to, more than the limits above."""
    try:
        return _load_bounded(text, source)
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
    an alias) is kept as a string; the field's type check still applies to it. A value
    that expands past the size limits is a :class:`ConfigError`.
    """
    if not text.strip():
        return ""
    try:
        return _load_bounded(text, "override value")
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
            raise ConfigError(
                "", f"malformed override {item!r}: expected KEY=VALUE with a dotted key, e.g. trainer.lr=1e-6"
            )
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
                    ".".join(parts[: i + 1]),
                    f"cannot apply override {item!r}: the field holds {child!r}, not a section",
                )
            node = child
        node[parts[-1]] = parse_override_value(raw)
    return result
