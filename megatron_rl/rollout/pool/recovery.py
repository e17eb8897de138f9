"""A pool's engines seen from the driver over Ray: how a dead engine's errors look, and
waiting for a restarted one (the pool's retries and restarts build on these).
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["DIED_FOR_GOOD_AFTER_S", "RolloutEngineError", "actor_errors", "wait_until_back"]


class RolloutEngineError(RuntimeError):
    """A rollout request or engine operation failed for good (the message names both)."""


def actor_errors() -> tuple[type[BaseException], ...]:
    """The Ray errors that mean an engine's actor process died (as opposed to its code raising)."""
    import ray.exceptions as rex

    return (rex.RayActorError, rex.WorkerCrashedError)


DIED_FOR_GOOD_AFTER_S = 30.0
"""How long calls to an engine may keep failing with ``ActorDiedError`` before it is
taken for out of restarts although the caller counted one left (see :func:`wait_until_back`)."""


def wait_until_back(
    actor: Any, name: str, *, timeout_s: float, replaces_pid: int | None = None, may_restart: bool = False
) -> dict[str, Any]:
    """Wait until a restarting engine actor answers; its health report.

    ``replaces_pid``: the process the restart replaces (known when the caller killed it).
    ``ray.kill`` is asynchronous, so a call made right after it can still be answered by
    the dying process; only an answer from another process means the engine is back.

    ``may_restart``: Ray still has a restart for this actor by the caller's count (its
    deaths so far <= ``max_restarts``). Then an ``ActorDiedError`` is a call racing the
    restart (a call that reaches the dead process before the driver learns of the
    restart reads "died"; on a loaded machine several in a row do), and is waited out
    for up to ``DIED_FOR_GOOD_AFTER_S``: the caller's count can miss a death (a process
    that died and was replaced before anyone asked it, then killed again), and calls to a
    restarting actor fail as ``ActorUnavailableError``, not "died", so "died" that goes on
    that long means it is out of restarts. Without a restart left, three such errors in a row
    mean it is. An actor whose constructor raised is dead at once either way (Ray does
    not re-run a constructor that failed).

    Raises :class:`RolloutEngineError` when it is out of restarts or not back in ``timeout_s``.
    """
    import ray

    deadline = time.monotonic() + timeout_s
    died, died_since = 0, None
    while time.monotonic() < deadline:
        try:
            health = ray.get(actor.health.remote(), timeout=max(1.0, deadline - time.monotonic()))
            if replaces_pid is None or health.get("pid") != replaces_pid:
                return health
            died, died_since = 0, None
            time.sleep(0.2)  # the old process answered: the kill has not landed yet
        except ray.exceptions.ActorDiedError as exc:
            died += 1
            died_since = time.monotonic() if died_since is None else died_since
            for_good = not may_restart and died >= 3
            if exc.actor_init_failed or for_good or time.monotonic() - died_since >= DIED_FOR_GOOD_AFTER_S:
                raise RolloutEngineError(f"{name} is dead and will not restart: {exc}") from exc
            time.sleep(0.5)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            died, died_since = 0, None
            time.sleep(0.2)
    raise RolloutEngineError(f"{name} did not come back within restart_timeout_s={timeout_s}")
