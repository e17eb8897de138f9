"""The field reference of a config tree, read from the docstring under each field.

Python keeps no such docstrings at runtime, so :func:`field_docs` reads them from the
class source with ``ast``; the reference (``docs/config.md``, :func:`render_docs`) thus
cannot drift from the code.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
from collections.abc import Iterator
from typing import Any

import yaml

from megatron_rl.config.lib.schema import (
    _is_union,
    _join,
    _type_hints,
    section_type,
    to_dict,
    type_label,
)


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
