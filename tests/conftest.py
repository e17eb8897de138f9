"""Test tiers by marker: ``unit``, ``distributed``, ``gpu``, ``slurm``, ``e2e``.

A test file's directory gives its default tier (``tests/unit`` -> ``unit``, ...), so
every test carries exactly one tier marker. ``gpu`` tests are skipped, with the reason
stated, when no CUDA device is present.
"""

import pytest
import torch

_TIERS = ("unit", "distributed", "gpu", "slurm", "e2e")


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    for item in items:
        parts = item.path.parts
        for tier in _TIERS:
            if tier in parts and not any(m.name in _TIERS for m in item.iter_markers()):
                item.add_marker(getattr(pytest.mark, tier))
        if item.get_closest_marker("gpu") and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device; none is visible to torch"))
