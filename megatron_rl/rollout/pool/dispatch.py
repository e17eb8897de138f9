"""How a ``RolloutPool.generate`` call is cut into requests and where each request goes.

Pure functions of the pool's counters (no Ray): a call's prompts become contiguous ranges
(:func:`split_requests`), each request goes to the live engine with the least outstanding
work that still has room (:func:`pick_engine`), and an engine that finished nothing for
``rollout.pool.request_timeout_s`` is found (:func:`wait_timeout`, :func:`hung_engines`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from megatron_rl.config.seeding import prompt_seeds_for
from megatron_rl.rollout.generation import SamplingParams, check_prompts

__all__ = ["Request", "hung_engines", "pick_engine", "plan_call", "split_requests", "wait_timeout"]


@dataclass
class Request:
    """One slice of a ``generate`` call: prompts ``[lo, hi)``."""

    index: int
    lo: int
    hi: int
    work: int
    """Estimated tokens: prompt tokens plus ``n * max_new_tokens`` per prompt."""
    num_requests: int
    attempts: int = 0
    engine: int = -1
    timed_out: bool = False

    def describe(self, num_prompts: int) -> str:
        return f"request {self.index}/{self.num_requests} (prompts {self.lo}..{self.hi - 1} of {num_prompts})"


def split_requests(
    prompts: Sequence[Sequence[int]], params: SamplingParams, *, num_live: int, max_prompts_per_request: int | None
) -> list[Request]:
    """Contiguous prompt ranges, one per live engine unless ``max_prompts_per_request``
    caps them; a prompt's ``n`` samples always stay in one request."""
    size = max_prompts_per_request or math.ceil(len(prompts) / max(1, num_live))
    bounds = [(lo, min(lo + size, len(prompts))) for lo in range(0, len(prompts), size)]
    return [
        Request(
            index=i,
            lo=lo,
            hi=hi,
            work=sum(len(p) + params.n * params.max_new_tokens for p in prompts[lo:hi]),
            num_requests=len(bounds),
        )
        for i, (lo, hi) in enumerate(bounds)
    ]


def plan_call(
    prompts: Sequence[Sequence[int]], params: SamplingParams, *, num_live: int, max_prompts_per_request: int | None
) -> tuple[list[list[int]], list[int], list[Request]]:
    """A ``generate`` call's checked prompts (lists of ints), the seed of each prompt (from
    its position in the whole call: results do not depend on the split) and its requests."""
    check_prompts(prompts)
    prompts = [list(map(int, p)) for p in prompts]
    seeds = prompt_seeds_for(params.seed, range(len(prompts)))
    requests = split_requests(prompts, params, num_live=num_live, max_prompts_per_request=max_prompts_per_request)
    return prompts, seeds, requests


def pick_engine(live: Sequence[int], outstanding: Sequence[int], queued: Sequence[int], *, cap: int) -> int | None:
    """The live engine with the least outstanding work (then fewest queued requests, then
    lowest index) among those with fewer than ``cap`` requests queued; ``None`` if all are full."""
    candidates = [i for i in live if queued[i] < cap]
    if not candidates:
        return None
    return min(candidates, key=lambda i: (outstanding[i], queued[i], i))


def _busy(inflight: Iterable[Request]) -> set[int]:
    """Engines with work in flight that have not already been killed for a time-out."""
    inflight = list(inflight)
    return {req.engine for req in inflight} - {req.engine for req in inflight if req.timed_out}


def wait_timeout(inflight: Iterable[Request], progress_at: Sequence[float], limit: float | None) -> float | None:
    """Seconds until a busy engine would exceed ``limit`` without progress (``None``: no
    limit, or nothing busy; requests of killed engines fail as soon as the kill lands).

    ``progress_at[e]`` is ``time.monotonic()`` when engine ``e`` got work while idle or
    last completed a request, so a request queued behind another is not charged its wait.
    """
    busy = _busy(inflight)
    if limit is None or not busy:
        return None
    return max(0.0, min(progress_at[e] for e in busy) + limit - time.monotonic())


def hung_engines(inflight: Iterable[Request], progress_at: Sequence[float], limit: float | None) -> list[int]:
    """Busy engines that finished nothing for ``limit`` seconds (see :func:`wait_timeout`)."""
    if limit is None:
        return []
    now = time.monotonic()
    return [e for e in sorted(_busy(inflight)) if now - progress_at[e] >= limit]
