"""The engines seen from the driver over Ray: the weight-sync control plane a sender
drives, how a dead engine's errors look, and waiting for a restarted one.

:class:`EngineGroupClient` has the four methods of vLLM's ``VLLMWeightSyncClient``
(``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``,
``finish_weight_update``), so vLLM's own trainer engines (``nccl``, ``ipc``) and the
project's ``gloo`` sender drive the same object. It is picklable (Ray actor handles and
numbers): the pool builds it, the actor's rank 0 uses it.

Two differences from vLLM's ``RayVLLMWeightSyncClient``, both because a pool holds
several independent engines rather than one engine with data-parallel replicas:

- ``init_weight_transfer_engine`` gives each engine its own ``rank_offset`` (engine
  ``i``'s workers follow those of engines ``0 .. i-1``), where vLLM's client sends one
  payload to all.
- start and finish are no-ops here: the pool opens every engine's update (checking the
  version's metadata first) before the sender starts, and commits it after the sender
  returns (``RolloutPool.begin_update`` / ``commit_update``), so a version is checked
  and recorded on both sides whichever backend moved it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "EngineGroupClient",
    "RolloutEngineError",
    "TransferFailedError",
    "actor_errors",
    "gather_calls",
    "wait_until_back",
]


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


class TransferFailedError(RuntimeError):
    """Engines failed during a weight transfer; ``engines`` are their pool indices."""

    def __init__(self, message: str, engines: Sequence[int]):
        super().__init__(message)
        self.engines = list(engines)

    def __reduce__(self):  # crosses Ray process boundaries: rebuild with both arguments
        return type(self), (str(self), self.engines)


def gather_calls(refs: dict[int, Any], names: Sequence[str], what: str, *, timeout_s: float | None) -> list[Any]:
    """``ray.get`` every engine's call; any failure raises :class:`TransferFailedError`
    naming each engine that failed and why (the others' calls are still waited for)."""
    import ray

    results, failures = [], []
    for engine, ref in refs.items():
        try:
            results.append(ray.get(ref, timeout=timeout_s))
        except Exception as exc:  # an engine's error, its death, or a time-out
            failures.append((engine, f"{names[engine]}: {type(exc).__name__}: {_short(exc)}"))
    if failures:
        raise TransferFailedError(f"{what} failed on " + "; ".join(m for _, m in failures), [e for e, _ in failures])
    return results


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[-1] if text else ""


@dataclass
class EngineGroupClient:
    """The weight-sync client of a set of pool engines (see the module docstring)."""

    actors: list[Any]
    """Ray handles of the engines' ``EngineWorker`` actors."""
    engines: list[int]
    """Their indices in the pool (named in errors)."""
    names: list[str]
    """Every pool engine's name, by index."""
    receivers: list[int]
    """Workers of each engine that join a transfer group."""
    timeout_s: float | None = None
    """How long to wait for an engine's call."""

    @property
    def world_size(self) -> int:
        """The transfer group's size: the sender and every receiving worker."""
        return 1 + sum(self.receivers)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        offset = 1
        refs = {}
        for engine, actor, count in zip(self.engines, self.actors, self.receivers):
            refs[engine] = actor.init_weight_transfer.remote({**init_info, "rank_offset": offset})
            offset += count
        gather_calls(refs, self.names, "joining the weight-transfer group", timeout_s=self.timeout_s)

    def start_weight_update(self) -> None:
        pass  # opened by the pool before the sender starts

    def update_weights(self, update_info: dict[str, Any]) -> None:
        refs = {e: a.receive_weights.remote(update_info) for e, a in zip(self.engines, self.actors)}
        gather_calls(refs, self.names, "receiving weights", timeout_s=self.timeout_s)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        pass  # committed by the pool after the sender returns
