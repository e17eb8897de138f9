"""pytest plugin of ``tools/cpu_by_process.py --by-test``: keeps the test this worker runs in
``$MRL_CPU_BY_TEST_DIR/<worker>`` (its pid, a newline, the test's id; empty between tests),
and names the worker in ``MRL_CPU_BY_TEST_WORKER``, which every process a test starts
inherits (xdist's worker id, ``main`` without xdist).

Only the outermost pytest of a worker writes: a pytest that a test starts inherits
``MRL_CPU_BY_TEST_OWNER``, and its tests are part of that test.
"""

from __future__ import annotations

import os

import pytest
from cpu_by_process import STATE_DIR_ENV, WORKER_ENV  # tools/ is on the path that loads this plugin

_DIR = os.environ.get(STATE_DIR_ENV)
_OWNED = "MRL_CPU_BY_TEST_OWNER"
_ACTIVE = bool(_DIR) and not os.environ.get(_OWNED)  # set once a test runs (not by xdist's controller)


def _write(test: str) -> None:
    worker = os.environ[WORKER_ENV]
    prefix = "matrix:" if ".mcore-" in os.environ.get("PYTHONPATH", "") else ""
    path = os.path.join(_DIR, worker)
    with open(path + ".tmp", "w") as f:
        f.write(f"{os.getpid()}\n{prefix + test if test else ''}")
    os.replace(path + ".tmp", path)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if _ACTIVE:
        os.environ[_OWNED] = str(os.getpid())  # inherited: a pytest this test starts leaves the file alone
        os.environ[WORKER_ENV] = os.environ.get("PYTEST_XDIST_WORKER", "main")
        _write(item.nodeid)
    yield
    if _ACTIVE:
        _write("")
