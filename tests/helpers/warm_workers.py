"""The e2e tier's kept processes: the actor ranks and engines its in-process runs on the
shared cluster (``tests/ray_cluster.py``) hand on to each other."""

from __future__ import annotations

import os

from tests.ray_cluster import has_fake_gpus, on_release

__all__ = ["warm_workers"]

_WARM: list = []
"""The ``loop.warm.WarmWorkers`` of the cluster that is up (empty: none made yet)."""


def warm_workers():
    """The kept processes (``loop.warm.WarmWorkers``: a run rebuilds kept processes of its
    shape instead of starting new ones, seconds of imports each); closed when the shared
    cluster is released. ``None`` on a cluster with (fake) GPUs (a GPU run's processes live
    in its own placement groups), or with ``MEGATRON_RL_TEST_COLD=1`` (every run starts its
    processes: what the kept ones save is measured against that)."""
    from megatron_rl.loop.warm import WarmWorkers

    if has_fake_gpus() or os.environ.get("MEGATRON_RL_TEST_COLD") == "1":
        return None
    if not _WARM:
        _WARM.append(WarmWorkers())
        on_release(lambda: _WARM.pop().close())
    return _WARM[0]
