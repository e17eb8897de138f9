"""The GPU install's known-good set resolves (pip's resolver, CPython 3.12, Linux x86-64).

Needs PyPI (CI has it); nothing is installed and no sdist is built
(``tools/lock_gpu_constraints.py`` documents how).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def lock(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("lock_gpu_constraints", REPO / "tools" / "lock_gpu_constraints.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.PIP = module.ensure_pip(tmp_path_factory.mktemp("pip"))
    return module


def test_the_constraints_file_resolves_exactly(lock):
    assert lock.check(lock.PIP) == []
    pins = lock.read_constraints()
    # the combination the docs promise
    assert pins["torch"] == "2.13.0" and pins["vllm"].startswith("0.32.") and pins["megatron-core"].startswith("0.19.")
    assert pins["transformer-engine-torch"] == pins["transformer-engine"]


def test_a_conflicting_pin_is_reported(lock, tmp_path):
    # vLLM 0.32 pins torch 2.13.0: asking for another torch must fail to resolve
    conflicting = tmp_path / "constraints.txt"
    conflicting.write_text("torch==2.12.0\n")
    with pytest.raises(RuntimeError, match="does not resolve"):
        lock.resolve(lock.PIP, lock.project_requirements(), conflicting)
