"""The package's structure rules (docs/design.md): import direction, no import cycles, and
each setting declared in one config class.

The import graph is read from the source with ``ast``, so it counts every import:
module level, inside functions and under ``TYPE_CHECKING`` alike.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import pkgutil
from collections import defaultdict
from pathlib import Path

import megatron_rl

PACKAGE_DIR = Path(megatron_rl.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE_DIR.rglob("*.py")}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The most specific module of ``name`` (``a.b.c`` may be a module or an attribute of ``a.b``)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """``{module: modules of megatron_rl it imports}``, every import statement counted."""
    modules = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolve against this module's package
                    anchor = name.split(".")
                    anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names]
            for target in targets:
                if target.startswith("megatron_rl"):
                    resolved = _resolve(target, modules)
                    if resolved and resolved != name:
                        graph[name].add(resolved)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    cycles, state, stack = [], {}, []

    def visit(node: str) -> None:
        state[node] = "active"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "active":
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return cycles


def _area(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_the_import_graph_sees_function_local_and_type_checking_imports():
    graph = import_graph()
    assert "megatron_rl.actor.update" in graph["megatron_rl.actor.ray_group"]  # imported inside a method
    assert "megatron_rl.rollout.pool" in graph["megatron_rl.builder"]


def test_no_import_cycles():
    cycles = _cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_dependencies_point_one_way():
    graph = import_graph()
    violations = []
    for module, imports in graph.items():
        area = _area(module)
        for target in imports:
            to = _area(target)
            if to == "commands" and area != "commands" and module != "megatron_rl.__main__":
                violations.append(f"{module} imports the command line ({target})")
            if area == "actor" and to == "rollout":
                violations.append(f"{module} (actor) imports {target} (rollout)")
            if area in ("rollout", "rewards", "tasks", "data") and to == "actor":
                violations.append(f"{module} ({area}) imports {target} (actor)")
            if area in ("rewards", "data") and to == "tasks":
                violations.append(f"{module} ({area}) imports {target} (tasks)")
            if area == "algo" and to not in ("algo", "configlib"):
                violations.append(f"{module} (algo) imports {target}")
            if area == "ops" and to not in ("ops", "algo", "configlib"):
                violations.append(f"{module} (ops) imports {target}")
            if area == "weight_transfer" and to not in ("weight_transfer",):
                violations.append(f"{module} (weight_transfer) imports {target}")
    assert not violations, "\n".join(sorted(violations))


# --------------------------------------------------------------------------- settings declared once

# Classes that hold settings: the run config's sections and the option classes components
# are configured with. Excluded: the fused op's per-call arguments (``ops``) and the
# conversion command's options and tensor metadata (``models``), which are not settings
# of a run.
_SETTINGS_SUFFIXES = ("Config", "Options", "Settings", "Spec", "Params", "Args")
# ``weight_transfer.vllm_backend`` subclasses vLLM's classes, so it imports only where vLLM
# is installed; it declares no settings (its init/update infos are wire formats).
_NOT_SETTINGS_PACKAGES = ("megatron_rl.ops", "megatron_rl.models", "megatron_rl.weight_transfer.vllm_backend")

# The same word naming different settings, each with its reason. Anything else declared
# in two classes is a copy and fails the test.
HOMONYMS = {
    "alpha": "ar.alpha and tr_grpo.alpha are each paper's own constant",
    "enabled": "the on/off switch of each token-weight method (lopti, tr_grpo, stapo)",
    "placement": "rollout.placement (where engines run) vs tr_grpo.placement (where the weight applies)",
    "dtype": "model.dtype (the actor's precision) vs the HF engine's own engine_args.dtype",
    "seed": "trainer.seed vs the per-request SamplingParams.seed derived from it and the step",
}


def _settings_classes() -> list[type]:
    classes = []
    for info in pkgutil.walk_packages(megatron_rl.__path__, "megatron_rl."):
        if info.name.endswith("__main__") or info.name.startswith(_NOT_SETTINGS_PACKAGES):
            continue
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if (
                isinstance(obj, type)
                and dataclasses.is_dataclass(obj)
                and obj.__module__ == module.__name__
                and name.endswith(_SETTINGS_SUFFIXES)
            ):
                classes.append(obj)
    return classes


def test_no_setting_is_declared_in_two_config_classes():
    owners: dict[str, list[str]] = defaultdict(list)
    classes = _settings_classes()
    assert {"RunConfig", "TrainerConfig", "OptimConfig", "ActorSpec", "SamplingParams", "PoolConfig"} <= {
        c.__name__ for c in classes
    }
    for cls in classes:
        hints = __import__("typing").get_type_hints(cls)
        for f in dataclasses.fields(cls):
            declared_here = f.name in cls.__dict__.get("__annotations__", {})
            is_section = dataclasses.is_dataclass(hints[f.name]) or any(
                dataclasses.is_dataclass(a) for a in getattr(hints[f.name], "__args__", ())
            )
            if declared_here and not is_section:  # a nested section is a reference, not a setting
                owners[f.name].append(f"{cls.__module__}.{cls.__qualname__}")
    copies = {name: where for name, where in owners.items() if len(where) > 1 and name not in HOMONYMS}
    assert not copies, f"settings declared in several classes: {copies}"
    unused = [name for name in HOMONYMS if len(owners.get(name, ())) < 2]
    assert not unused, f"HOMONYMS entries that no longer apply: {unused}"
