"""The one place that knows how the supported megatron-core releases differ.

Supported: ``megatron-core>=0.16.1,<0.20`` (:data:`SUPPORTED`, the pin in setup.py).
Tested: 0.16.1 with the whole suite, and 0.19.2 with the ``unit`` and ``distributed``
tiers (``tools/ci_mcore_matrix.sh``). Everything else in megatron_rl calls the
megatron-core API that all of these releases share; where a release changed something
megatron_rl depends on, the call site goes through a helper here, which dispatches on
the installed version. No other module compares megatron-core versions.

What changed, release by release (only what megatron_rl runs into):

0.17.0
    The wheels declare ``Requires-Python >=3.12``, but their code runs on CPython 3.11
    (every module compiles; the tiers pass on 3.11). The CI check therefore installs
    them on 3.11 with ``pip install --ignore-requires-python``, because 3.11 is the
    Python with a CPU build of torch 2.13 here (the 3.12 torch on PyPI is the CUDA
    build). No API that megatron_rl uses changed.
0.18.0
    ``megatron.core.pipeline_parallel.schedules`` imports ``transformer.moe.paged_stash``,
    whose Triton kernels ``import triton`` at module level, so ``import megatron.core``
    needs Triton. megatron-core does not declare it and torch's CPU build does not bring
    it (the CUDA build does): :func:`extra_requirements` names it, and
    ``tools/ci_mcore_matrix.sh`` installs it. Triton imports without a GPU; none of its
    kernels runs on a CPU.
0.19.0
    The DDP gradient sync (``_ParamAndGradBucketGroup.start_grad_sync``) calls
    ``torch.cuda.current_stream()`` on every call, to wait for CUDA-graph weight-gradient
    events that a parameter may carry, even when none does. On a CPU-only torch that
    raises ``AssertionError: Torch not compiled with CUDA enabled``; the CPU shim
    (``megatron_rl.actor.compat.cpu_shim.apply``) installs, for every release, a stream
    stand-in whose waits do nothing (on a CPU every operation has finished when it
    returns; the mixture-of-experts token dispatcher of every release needs it too).
    Nothing of megatron is patched, and a CUDA process is never touched.
    Notices only, no change in results: ``GPTModel`` prints that it is deprecated in
    favour of ``HybridModel``, and DDP that it computes the DistributedOptimizer's
    parameter layout itself (``full_param_layout`` not given).

This module imports neither torch's CUDA parts nor megatron-core at import time
(``tools/ci_mcore_matrix.sh`` asks :func:`extra_requirements` before megatron-core can
be imported).
"""

from __future__ import annotations

import functools

from packaging.specifiers import SpecifierSet
from packaging.version import Version

__all__ = [
    "SUPPORTED",
    "TRITON_REQUIREMENT",
    "at_least",
    "extra_requirements",
    "is_supported",
    "mcore_version",
]

SUPPORTED = SpecifierSet(">=0.16.1,<0.20")
"""The megatron-core releases megatron_rl supports (setup.py pins the same range)."""

TRITON_REQUIREMENT = "triton==3.8.0"
"""What megatron-core 0.18+ needs to import on a CPU torch (any Triton 3.x imports; this
one is the pin the CI check installs)."""

_TRITON_SINCE = Version("0.18.0")


@functools.cache
def mcore_version() -> Version:
    """The version of the megatron-core that ``import megatron.core`` loads (not only the
    installed distribution's metadata: a source tree earlier on ``sys.path`` wins)."""
    from megatron.core import package_info

    return Version(package_info.__version__)


def at_least(version: str | Version, *, installed: str | Version | None = None) -> bool:
    """Whether the megatron-core in use (or ``installed``) is ``version`` or newer.
    Pre-releases and dev builds count as the release they lead to."""
    have = Version(str(installed)) if installed is not None else mcore_version()
    return Version(have.base_version) >= Version(str(version))


def is_supported(installed: str | Version | None = None) -> bool:
    """Whether the megatron-core in use (or ``installed``) is in :data:`SUPPORTED`."""
    have = Version(str(installed)) if installed is not None else mcore_version()
    return SUPPORTED.contains(have, prereleases=True)


def extra_requirements(installed: str | Version) -> tuple[str, ...]:
    """Requirements that megatron-core ``installed`` needs in order to import on a CPU build of
    torch but does not declare (0.18+: Triton, see the module docstring). Takes the
    version as an argument: it is asked before megatron-core can be imported."""
    if at_least(_TRITON_SINCE, installed=installed):
        return (TRITON_REQUIREMENT,)
    return ()
