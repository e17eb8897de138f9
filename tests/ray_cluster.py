"""One local Ray cluster per test tier, instead of one per test module.

Starting a cluster costs seconds on the 2-core CI machine, and a tier's modules want the
same one: :func:`shared_ray` starts it on the first call of a tier and keeps it for that
tier's later modules; a call from another tier (or :func:`release_ray`, for a test that
needs a cluster of its own) shuts it down first. ``tests/conftest.py`` shuts the last one
down at the end of the session.

The trainer's tests (``e2e``) get Ray's default CPUs, the machine's cores, because the
trainer sizes its torch threads by them; the pool and weight-sync tests get four logical
CPUs, room for two engines beside the actor ranks.

This module imports nothing that imports megatron-core: the tests of every tier use it, and
the megatron-core matrix selects tests by what they import (``tests/import_graph.py``).
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["has_fake_gpus", "on_release", "release_ray", "shared_ray"]

_CURRENT: list[str] = []
"""The tier whose cluster is up (empty: none of ours)."""

_ON_RELEASE: list[Callable[[], None]] = []
"""Closed before the cluster goes (:func:`on_release`)."""

_NUM_CPUS = {"e2e": None}
"""Logical CPUs of each tier's cluster (``None``: Ray's default); other tiers: 4."""

_NUM_GPUS = {"vllm": 4}
"""Fake GPUs of each tier's cluster (a Ray resource only): the vLLM tier places a
tensor-parallel engine with the project's GPU placement groups; other tiers: none."""


def shared_ray(tier: str) -> None:
    """Make sure the shared cluster of ``tier`` is up (``ray.init`` in this process)."""
    import ray

    from megatron_rl.cluster.local_ray import start_local_ray

    if ray.is_initialized() and _CURRENT != [tier]:
        release_ray()
    if not ray.is_initialized():
        # address="local": a cluster of its own, never one a `ray start` on this machine left named in
        # /tmp/ray/ray_current_cluster (what ray.init() without an address would join).
        # Started again if the node does not come up (a slow dashboard agent on a busy machine).
        start_local_ray(lambda: ray.init(address="local", num_cpus=_NUM_CPUS.get(tier, 4), num_gpus=_NUM_GPUS.get(tier, 0),
                                         include_dashboard=False, configure_logging=False, log_to_driver=False))  # fmt: skip
        _CURRENT[:] = [tier]


def on_release(close: Callable[[], None]) -> None:
    """Call ``close`` before the shared cluster goes (what lives on it: kept processes)."""
    _ON_RELEASE.append(close)


def has_fake_gpus() -> bool:
    """Whether the cluster that is up is a tier's with (fake) GPUs."""
    return any(_NUM_GPUS.get(tier) for tier in _CURRENT)


def release_ray() -> None:
    """Shut the shared cluster (or any cluster of this process) down."""
    import ray

    while _ON_RELEASE:
        _ON_RELEASE.pop()()
    if ray.is_initialized():
        ray.shutdown()
    _CURRENT.clear()
