"""Actor ranks and rollout engines kept between the runs one driver process builds.

Starting an actor rank or an engine costs seconds of CPU before it does any work
(importing torch, megatron-core or transformers; joining the torch.distributed world); a
driver that builds several runs one after another in one Ray session (a notebook
comparing settings, the project's tests) pays it once per set of processes with
:class:`WarmWorkers`: ``build_run(config, warm=warm)`` takes kept processes of the same
shape and rebuilds in them, and ``Run.close`` hands them back instead of stopping them.

* Actor ranks: a kept group of the same placement (as many ranks, the same Ray options
  and torch threads) builds the actor again from the run's spec
  (:meth:`ActorGroup.rebuild`): every rank is seeded as a fresh group's would be, so the
  run's numbers are those of new processes.
* Engines: kept engine actors whose constructor arguments and placement are the run's
  build their engines again (``EngineWorker.reset``), exactly as a Ray restart would
  (which runs that same constructor). The engines of runs that start from a config alone
  (``RUN_DIR/engine_init``) get one copy of that directory per content, held here, so
  runs of the same model and tokenizer have the same arguments.

A group or pool is handed back only when every process answers at once and none was
restarted or given up (a run that failed with a process dead or stuck stops them as
without ``warm``). Kept engines hold their Ray resources (a CPU each), so they are
stopped before new engines start; at most :data:`MAX_KEPT_ACTOR_RANKS` actor ranks are
kept (on CPU they reserve no Ray resource, only their memory). GPU runs are refused: their processes live in the run's placement
groups, which go with the run. Kept processes live until :meth:`WarmWorkers.close` or
the end of the Ray session.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

from megatron_rl.actor.group import ActorGroup
from megatron_rl.actor.spec import ActorSpec
from megatron_rl.cluster.placement import GroupPlacement
from megatron_rl.config.rollout import RolloutConfig
from megatron_rl.rollout.pool.pool import RolloutPool, stop_engines

__all__ = ["WarmWorkers"]

logger = logging.getLogger(__name__)

MAX_KEPT_ACTOR_RANKS = 4
"""Actor rank processes kept at most (the oldest groups stop first): each holds its memory."""

HAND_BACK_TIMEOUT_S = 10.0
"""How long every kept process may take to answer a trivial call (handed back or out)."""


def _key(*parts: Any) -> str:
    return json.dumps(parts, sort_keys=True, default=repr)


def _take(kept: list[tuple[str, Any]], key: str) -> Any:
    """Remove and return the newest item kept under ``key`` (None: none is)."""
    for i in range(len(kept) - 1, -1, -1):
        if kept[i][0] == key:
            return kept.pop(i)[1]
    return None


class WarmWorkers:
    """Actor groups and engine actors kept between runs in this driver process (module docstring)."""

    def __init__(self) -> None:
        self._groups: list[tuple[str, ActorGroup]] = []
        """The kept actor groups with their placement's key, oldest first."""
        self._engines: list[tuple[str, list[Any]]] = []
        """The kept engine actors of a pool each, with their key, oldest first."""
        self._handed_out: dict[int, str] = {}
        """id(group or pool) -> the key it was handed out under."""
        self._dirs: Path | None = None
        self.started = {"actor_groups": 0, "pools": 0}
        """Groups and pools started because none of their shape was kept."""
        self.reused = {"actor_groups": 0, "pools": 0}
        """Groups and pools rebuilt for a run instead of started."""

    # ------------------------------------------------------------------ actor ranks

    def actor_group(self, spec: ActorSpec, placement: GroupPlacement, *, wait: bool = True) -> ActorGroup:
        """A group for ``spec`` at ``placement``: a kept one rebuilt, else a new one."""
        key = _key(placement.torch_threads, placement.ray_options, placement.visible_devices)
        group = _take(self._groups, key)
        if group is not None:
            try:
                # A rank that died while kept fails here, before the rebuild (which may not wait).
                if not group.answers(timeout_s=HAND_BACK_TIMEOUT_S):
                    raise RuntimeError("a rank of the kept group does not answer")
                group.rebuild(spec, wait=wait)
                self.reused["actor_groups"] += 1
            except Exception:  # noqa: BLE001  (a group that cannot rebuild is replaced, not reused)
                logger.warning("a kept actor group cannot be rebuilt; starting a new one", exc_info=True)
                group.shutdown()
                group = None
        if group is None:
            group = ActorGroup(spec, placement, wait=wait)
            self.started["actor_groups"] += 1
        self._handed_out[id(group)] = key
        return group

    def hand_back_actors(self, group: ActorGroup) -> None:
        """Keep ``group`` for a later run if every rank answers within
        :data:`HAND_BACK_TIMEOUT_S`; stop it otherwise (or if it did not come from here)."""
        key = self._handed_out.pop(id(group), None)
        if key is None or not group.answers(timeout_s=HAND_BACK_TIMEOUT_S):
            group.shutdown()
            return
        self._groups.append((key, group))
        while sum(len(g.workers) for _, g in self._groups) > MAX_KEPT_ACTOR_RANKS:
            self._groups.pop(0)[1].shutdown()

    # ------------------------------------------------------------------ engines

    def engine_dir(self, directory: Path) -> Path:
        """This process's copy of a config-only engine directory (``RUN_DIR/engine_init``),
        one per content: the engines of runs of the same model get the same path."""
        files = sorted(p for p in directory.rglob("*") if p.is_file())
        digest = hashlib.sha256()
        for path in files:
            digest.update(str(path.relative_to(directory)).encode() + b"\0" + path.read_bytes() + b"\0")
        if self._dirs is None:
            self._dirs = Path(tempfile.mkdtemp(prefix="megatron_rl_warm_"))
        copy = self._dirs / digest.hexdigest()[:16]
        if not copy.exists():
            tmp = copy.with_name(copy.name + ".tmp")
            shutil.copytree(directory, tmp)
            tmp.rename(copy)
        return copy

    def pool(self, config: RolloutConfig, model_path: str, *, placement: GroupPlacement, **kwargs: Any) -> RolloutPool:
        """A :class:`RolloutPool` (``kwargs``: its keyword arguments): kept engine actors of
        the same arguments and placement reset, else new ones."""
        key = _key(config.engine, model_path, config.engine_args, config.num_engines, config.tensor_parallel_size,
                   config.routing_replay, config.pool.max_restarts, placement.torch_threads, placement.ray_options,
                   placement.visible_devices, kwargs)  # fmt: skip
        kept, pool = _take(self._engines, key), None
        if kept is not None:
            try:
                pool = RolloutPool(config, model_path, placement=placement, workers=kept, **kwargs)
                self.reused["pools"] += 1
            except Exception:  # noqa: BLE001  (the pool stopped the engines; new ones instead)
                logger.warning("kept engines failed to reset; starting new ones", exc_info=True)
        if pool is None:
            self._stop_engines()  # kept engines hold their Ray resources: the new ones may need them
            pool = RolloutPool(config, model_path, placement=placement, **kwargs)
            self.started["pools"] += 1
        self._handed_out[id(pool)] = key
        return pool

    def hand_back_engines(self, pool: RolloutPool) -> None:
        """Keep ``pool``'s engine actors for a later run if none was restarted or given up
        and each answers within :data:`HAND_BACK_TIMEOUT_S`; shut the pool down otherwise."""
        key = self._handed_out.pop(id(pool), None)
        if key is not None and pool.answers(timeout_s=HAND_BACK_TIMEOUT_S):
            self._engines.append((key, list(pool.actors)))  # not the pool: its kept weight buckets go
        else:
            pool.shutdown()

    # ------------------------------------------------------------------

    def close(self) -> None:
        """Stop every kept process; remove the engine directories."""
        groups, self._groups = self._groups, []
        for _, group in groups:
            group.shutdown()
        self._stop_engines()
        if self._dirs is not None:
            shutil.rmtree(self._dirs, ignore_errors=True)
            self._dirs = None

    def _stop_engines(self) -> None:
        kept, self._engines = self._engines, []
        for _, actors in kept:
            stop_engines(actors)
