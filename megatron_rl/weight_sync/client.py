"""The engines of a pool as the weight-sync client a sender drives, over Ray.

:class:`EngineGroupClient` has the four methods of vLLM's ``VLLMWeightSyncClient``
(``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``,
``finish_weight_update``), so vLLM's own trainer engines (``nccl``, ``ipc``) and the
project's ``gloo`` sender drive the same object. It is picklable (Ray actor handles and
numbers): the pool builds it (``RolloutPool.client``), the actor's rank 0 uses it.

Two differences from vLLM's ``RayVLLMWeightSyncClient``, both because a pool holds
several independent engines rather than one engine with data-parallel replicas:

- ``init_weight_transfer_engine`` gives each engine of a rendezvous group (``nccl``,
  ``gloo``) its own ``rank_offset`` (engine ``i``'s workers follow those of engines
  ``0 .. i-1``), where vLLM's client sends one payload to all; ``ipc``'s handshake
  (``{"packed": ...}``, no group) reaches every engine unchanged.
- start and finish are no-ops here: the pool opens every engine's update (checking the
  version's metadata first) before the sender starts, and commits it after the sender
  returns (``RolloutPool.begin_update`` / ``commit_update``), so a version is checked
  and recorded on both sides whichever backend moved it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["EngineGroupClient", "TransferFailedError", "gather_calls"]


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
        # A rendezvous group (nccl, gloo: ``world_size`` in the init info) numbers every
        # engine's workers after the sender's rank 0; IPC has no group, and vLLM refuses
        # fields its init info does not declare, so its payload goes to every engine as is.
        grouped = "world_size" in init_info
        offset = 1
        refs = {}
        for engine, actor, count in zip(self.engines, self.actors, self.receivers):
            refs[engine] = actor.init_weight_transfer.remote(
                {**init_info, "rank_offset": offset} if grouped else init_info
            )
            offset += count
        gather_calls(refs, self.names, "joining the weight-transfer group", timeout_s=self.timeout_s)

    def start_weight_update(self) -> None:
        pass  # opened by the pool before the sender starts

    def update_weights(self, update_info: dict[str, Any]) -> None:
        refs = {e: a.receive_weights.remote(update_info) for e, a in zip(self.engines, self.actors)}
        gather_calls(refs, self.names, "receiving weights", timeout_s=self.timeout_s)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        pass  # committed by the pool after the sender returns
