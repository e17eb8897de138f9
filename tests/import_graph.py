"""Imports read from the source with ``ast``: the package's import graph (the structure
test) and which test modules exercise megatron-core (the ``mcore`` marker, conftest.py).

Every import statement counts, module level, inside functions and under
``TYPE_CHECKING`` alike; each edge also says whether it runs at module level.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from functools import lru_cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE_DIR = REPO / "megatron_rl"

__all__ = ["PACKAGE_DIR", "exercises_megatron", "import_graph", "imports_of", "megatron_modules"]


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@lru_cache(maxsize=1)
def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE_DIR.rglob("*.py")}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The most specific module of ``name`` (``a.b.c`` may be a module or an attribute of ``a.b``)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(path: Path, name: str | None = None) -> list[tuple[str, bool]]:
    """``(imported name, at module level)`` of every import statement of the file ``path``
    (``name``: its dotted module name, to resolve relative imports)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    is_package = path.name == "__init__.py"
    module_level = {id(n) for n in tree.body}
    out: list[tuple[str, bool]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, id(node) in module_level) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level and name:  # relative: resolve against this module's package
                anchor = name.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            out += [(f"{base}.{a.name}", id(node) in module_level) for a in node.names]
    return out


def import_graph(*, module_level_only: bool = False) -> dict[str, set[str]]:
    """``{module: modules of megatron_rl it imports}``, every import statement counted (or
    only those that run at import time)."""
    modules = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        for target, top in imports_of(path, name):
            if target.startswith("megatron_rl") and (top or not module_level_only):
                resolved = _resolve(target, modules)
                if resolved and resolved != name:
                    graph[name].add(resolved)
    return graph


def _imports_megatron(path: Path) -> bool:
    return any(t == "megatron" or t.startswith("megatron.") for t, _ in imports_of(path))


@lru_cache(maxsize=1)
def megatron_modules() -> frozenset[str]:
    """The megatron_rl modules that run megatron-core: those that import it (anywhere in
    the file) and every module that imports one of them at module level."""
    modules = _modules()
    found = {name for name, path in modules.items() if _imports_megatron(path)}
    graph = import_graph(module_level_only=True)
    # Packages count as importing what their __init__ imports at module level.
    changed = True
    while changed:
        changed = False
        for name, targets in graph.items():
            if name not in found and targets & found:
                found.add(name)
                changed = True
    return frozenset(found)


_SCRIPT = re.compile(r"(?:^|/)(\w+)\.py$")


def _named_scripts(tree: ast.Module) -> list[Path]:
    """Helper and benchmark scripts a file names in its code (string constants ending in
    ``NAME.py`` that name a file of ``tests/helpers`` or ``benchmarks``; docstrings aside)."""
    docstrings = {
        id(node.body[0].value) for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body
        and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
    }  # fmt: skip
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            match = _SCRIPT.search(node.value)
            if match:
                found += [REPO / folder / f"{match.group(1)}.py" for folder in ("tests/helpers", "benchmarks")]
    return found


def _direct(path: Path) -> tuple[bool, list[Path]]:
    """Whether ``path`` itself reaches megatron-core, and the other files it runs (test
    helpers and a script's own modules it imports, helper and benchmark scripts it names)."""
    users, modules = megatron_modules(), _modules()
    follow: list[Path] = []
    for target, _ in imports_of(path):
        if target == "megatron" or target.startswith("megatron."):
            return True, []
        if target.startswith("megatron_rl"):
            if _resolve(target, modules) in users:
                return True, []
        elif target.startswith("tests."):
            helper = REPO / Path(*target.split(".")).with_suffix(".py")
            while not helper.is_file() and helper.parent != REPO:
                helper = helper.parent.with_suffix(".py")
            follow.append(helper)
        else:
            follow.append(path.parent / f"{target.partition('.')[0]}.py")  # a script's own modules
    follow += _named_scripts(ast.parse(path.read_text(encoding="utf-8")))
    return False, [f for f in follow if f.is_file() and f != path]


@lru_cache(maxsize=None)
def exercises_megatron(path: Path) -> bool:
    """Whether the test file ``path`` runs megatron-core code: it imports megatron, or a
    megatron_rl module of :func:`megatron_modules`, or runs a file that does: a test
    helper or a script's own module it imports (at any level), a helper worker or
    benchmark script it names (a torchrun job, a benchmark run as a subprocess)."""
    seen, todo = set(), [Path(path)]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        hit, more = _direct(current)
        if hit:
            return True
        todo += more
    return False
