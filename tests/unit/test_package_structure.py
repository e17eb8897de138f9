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
from tests.import_graph import PACKAGE_DIR, import_graph


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


# The layers, lowest first: a package may import itself and the packages listed for it,
# nothing else (docs/design.md draws the same map). ``config.lib`` (the config machinery)
# and ``storage`` (durable files) are leaves; ``algo`` is pure math; ``config`` (the run's
# sections) composes ``algo``'s section; ``weight_sync`` is imported by both ``actor`` and
# ``rollout`` and imports neither; ``loop`` drives every component; ``cli`` is the front end.
ALLOWED: dict[str, set[str]] = {
    "config.lib": set(),
    "storage": set(),
    "algo": {"config.lib"},
    "ops": {"algo", "config.lib"},
    "config": {"config.lib", "algo"},
    "models": {"config.lib"},
    "data": {"config.lib"},
    "rewards": {"config.lib"},
    "tasks": {"config.lib", "data", "rewards"},
    "observability": {"config.lib", "storage"},
    "cluster": {"config.lib", "config", "models", "ops"},
    "weight_sync": {"config.lib", "config", "models"},
    "actor": {"config.lib", "config", "storage", "algo", "ops", "models", "observability", "cluster", "weight_sync"},
    "rollout": {"config.lib", "config", "models", "cluster", "weight_sync"},
    "loop": {
        "config.lib", "config", "storage", "algo", "ops", "models", "data", "rewards", "tasks", "observability",
        "cluster", "weight_sync", "actor", "rollout",
    },  # fmt: skip
    "cli": set(),  # filled below: everything
    "": {"cli"},  # the package root: ``__init__`` imports nothing, ``__main__`` the command line
}
ALLOWED["cli"] = {area for area in ALLOWED if area not in ("cli", "")}

ROOT_FILES = {"__init__.py", "__main__.py"}


def _area(module: str) -> str:
    parts = module.split(".")
    if parts[1:3] == ["config", "lib"]:
        return "config.lib"
    return parts[1] if len(parts) > 1 and parts[1] != "__main__" else ""


def test_the_import_graph_sees_function_local_and_type_checking_imports():
    graph = import_graph()
    assert "megatron_rl.actor.update" in graph["megatron_rl.actor.worker"]  # imported inside a method
    assert "megatron_rl.rollout.pool.pool" in graph["megatron_rl.loop.builder"]


def test_no_import_cycles():
    cycles = _cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_package_root_holds_no_loose_modules():
    loose = sorted(p.name for p in PACKAGE_DIR.glob("*.py") if p.name not in ROOT_FILES)
    assert not loose, f"modules at the package root (each belongs in a sub-package): {loose}"


def test_every_package_says_what_it_owns():
    for init in sorted(PACKAGE_DIR.rglob("__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8")))
        assert doc and len(doc.split()) >= 8, f"{init.relative_to(PACKAGE_DIR.parent)} has no docstring saying what it owns"


def test_every_area_is_in_the_layer_map():
    areas = {_area(m) for m in import_graph()} | {_area(t) for ts in import_graph().values() for t in ts}
    assert areas <= set(ALLOWED), f"packages missing from ALLOWED: {sorted(areas - set(ALLOWED))}"


def test_dependencies_point_one_way():
    graph = import_graph()
    violations = []
    for module, imports in graph.items():
        area = _area(module)
        for target in imports:
            to = _area(target)
            if to != area and to not in ALLOWED[area]:
                violations.append(f"{module} ({area or 'root'}) imports {target} ({to})")
    assert not violations, "\n".join(sorted(violations))


# --------------------------------------------------------------------------- settings declared once

# Classes that hold settings: the run config's sections and the option classes components
# are configured with. Excluded: the fused op's per-call arguments (``ops``) and the
# conversion command's options and tensor metadata (``models``), which are not settings
# of a run.
_SETTINGS_SUFFIXES = ("Config", "Options", "Settings", "Spec", "Params", "Args")
# ``weight_sync.transports.vllm`` subclasses vLLM's classes, so it imports only where vLLM
# is installed; it declares no settings (its init/update infos are wire formats).
_NOT_SETTINGS_PACKAGES = ("megatron_rl.ops", "megatron_rl.models", "megatron_rl.weight_sync.transports.vllm")

# The same word naming different settings, each with its reason. Anything else declared
# in two classes is a copy and fails the test.
HOMONYMS = {
    "alpha": "ar.alpha and tr_grpo.alpha are each paper's own constant; actor.lora.alpha scales the adapters",
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


def test_the_mcore_marker_finds_the_tests_that_run_megatron():
    """The megatron-core matrix runs the tests marked ``mcore``: those importing megatron
    through megatron_rl, through a torchrun worker, or through a benchmark script."""
    from tests.import_graph import exercises_megatron

    tests = Path(__file__).resolve().parents[1]
    for name in ("distributed/test_actor_scale.py", "distributed/test_planner.py", "unit/test_gpu_suite.py",
                 "unit/test_models_adapters.py", "distributed/test_convert.py"):  # fmt: skip
        assert exercises_megatron(tests / name), name
    for name in ("unit/test_policy_loss.py", "unit/test_config.py", "distributed/test_loss_invariance.py"):
        assert not exercises_megatron(tests / name), name


def test_the_benchmark_reference_stays_a_reference():
    """docs/benchmarks.md: one current table per benchmark, history in benchmarks/results/."""
    doc = PACKAGE_DIR.parent / "docs" / "benchmarks.md"
    lines = doc.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 400, f"{doc.name} has {len(lines)} lines: move earlier runs to benchmarks/results/<script>/"
    sections = [line for line in lines if line.startswith("## ")]
    assert len(sections) == len(set(sections)), f"a benchmark has two sections in {doc.name}"
