"""Build a run's components from its :class:`~megatron_rl.config.run.RunConfig`.

The only module that maps the whole run config onto components: each component gets
the sections it needs, by reference. Order matters and is the same on every run:

1. cheap and strict first, so a bad file, row, name or checkpoint fails before any
   process starts: :func:`~megatron_rl.loop.preflight.preflight` (the task, the architecture,
   the engine, the checkpoint to resume from, the tokenizer, every data row, the run
   directory); the rows are then drawn by a :class:`~megatron_rl.data.source.PromptSource`;
2. Ray, then the actor ranks (:class:`~megatron_rl.actor.group.ActorGroup`, built
   from an :class:`~megatron_rl.actor.spec.ActorSpec`) with their initial weights;
3. the directory the rollout engines start from (the run's HF directory, or config and
   tokenizer alone: the first sync then brings the actor's initial weights), the engine
   pool, and the run's weight sync (``weight_sync/sync.py``, transport from
   ``rollout.weight_transport``). Unless the engines share GPUs with the actor, steps 2
   and 3 overlap: the actor ranks build their models while the engines start;
4. the reward workers and the metrics sink.

Placement (where each actor rank and engine runs) comes from :mod:`megatron_rl.cluster.placement`:
placement groups on a GPU cluster, checked against the cluster before any actor starts.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch

from megatron_rl.actor.group import ActorGroup
from megatron_rl.actor.spec import ActorSpec
from megatron_rl.actor.worker import is_hf_directory
from megatron_rl.cluster.local_ray import LEAN_RAY_SYSTEM_CONFIG, start_local_ray
from megatron_rl.cluster.placement import (
    GroupPlacement,
    RunPlacement,
    actor_placement,
    alive_nodes,
    cpu_threads,
    engine_placement,
    place_on_gpus,
    plan_gpu_placement,
    write_placement,
)
from megatron_rl.config.lib import ConfigError, save_resolved, to_dict
from megatron_rl.config.parallel import ParallelConfig
from megatron_rl.config.rollout import RolloutConfig
from megatron_rl.config.run import RunConfig
from megatron_rl.data.source import PromptSource
from megatron_rl.loop.preflight import Preflight, preflight
from megatron_rl.loop.run_lock import RunDirLock, lock_run_dir
from megatron_rl.loop.warm import WarmWorkers
from megatron_rl.models import adapter_for_config
from megatron_rl.observability import MetricsSink
from megatron_rl.observability.run_log import LOG_DIR_ENV
from megatron_rl.rewards import RewardPool
from megatron_rl.rollout.pool.local import LocalRolloutPool
from megatron_rl.rollout.pool.pool import RolloutPool
from megatron_rl.rollout.pool.worker import engine_class
from megatron_rl.tasks import Task
from megatron_rl.weight_sync.sync import WeightSync, resolve_transport

__all__ = ["RayClusterError", "Run", "actor_spec", "build_run", "close_all", "placements", "start_ray"]

logger = logging.getLogger(__name__)


class RayClusterError(RuntimeError):
    """The Ray cluster ``RAY_ADDRESS`` names cannot be joined (the message names the address)."""


@dataclass
class Run:
    """The components of one run, built by :func:`build_run` and driven by the trainer."""

    config: RunConfig
    """The resolved run config (saved as ``RUN_DIR/config.yaml``)."""
    checkpoint_dir: Path
    """``RUN_DIR/checkpoints``."""
    resume_from: Path | None
    """The checkpoint (or checkpoint directory with ``latest``) to resume from, if any."""
    task: Task
    """Prompt style, reward and eval grouping."""
    prompts: PromptSource
    """Training prompts in a resumable order, eval prompts, tokenisation."""
    actors: ActorGroup
    """The Megatron actor's ranks."""
    pool: RolloutPool | LocalRolloutPool
    """The rollout engines."""
    weight_sync: WeightSync
    """The actor's weights into the engines, one version per step."""
    rewards: RewardPool
    """Time-limited workers scoring responses with the task's reward."""
    sink: MetricsSink
    """Metrics to ``RUN_DIR/metrics.jsonl`` (and wandb)."""
    placement: RunPlacement | None = None
    """The placement groups of a GPU cluster (None on CPU)."""
    engines_await_weights: bool = False
    """The engines started without weights (``RUN_DIR/engine_init``): the run syncs version
    0 into them before anything generates."""
    lock: RunDirLock | None = None
    """This process's hold on the run directory (``loop.run_lock``), released by :meth:`close`."""
    warm: WarmWorkers | None = None
    """Where :meth:`close` hands the actor ranks and engines back instead of stopping them
    (``loop.warm``)."""

    def close(self) -> None:
        """Stop the engines, actor ranks and reward workers; flush the metrics; release the run
        directory. Every part is closed even if one fails (a rank that died makes its group's
        clean-up raise); the first error is raised at the end."""
        try:
            close_all(self.sink.close, self.rewards.close, self.weight_sync.close, self._release_pool,
                      self._release_actors, self.placement and self.placement.remove, self.lock and self.lock.release)
        finally:
            self.lock = None

    def _release_pool(self) -> None:
        if self.warm is not None and isinstance(self.pool, RolloutPool):
            self.warm.hand_back_engines(self.pool)
        else:
            self.pool.shutdown()

    def _release_actors(self) -> None:
        if self.warm is not None:
            self.warm.hand_back_actors(self.actors)
        else:
            self.actors.shutdown()


def close_all(*closers: Callable[[], Any] | None) -> None:
    """Call every closer (``None`` ones skipped), each even if an earlier one raised (a rank
    that died makes its group's clean-up raise); then raise the first error, if any."""
    errors = []
    for close in closers:
        try:
            if close:
                close()
        except Exception as e:  # noqa: BLE001  (the others still close)
            errors.append(e)
    if errors:
        raise errors[0]


def actor_spec(config: RunConfig) -> ActorSpec:
    """What every actor rank is built from: the architecture and the sections it reads."""
    model = config.model
    return ActorSpec(
        architecture=model.hf_config if model.hf_config is not None else model.tiny.to_hf_config_dict(),
        model=model,
        parallel=config.parallel,
        trainer=config.trainer,
        actor=config.actor,
        algorithm=config.algorithm,
        rollout=config.rollout,
    )


def _write_engine_config(run_dir: Path, hf_config: dict[str, Any], tokenizer, dtype: str) -> Path:
    """The directory the engines start from when the run does not start from a HF directory
    (random init, a Megatron checkpoint): ``RUN_DIR/engine_init`` with the config and the
    tokenizer, no weights. An engine started from it builds the architecture and waits for
    weight version 0, which the first sync brings (``WeightReceiver``), so the engines start
    while the actor ranks build and no copy of the weights goes through the disk. Written
    under ``.tmp`` and renamed, so a crash leaves no half-written directory."""
    directory = run_dir / "engine_init"
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    hf = dict(hf_config)
    hf.setdefault("architectures", [adapter_for_config(hf).architecture or "AutoModelForCausalLM"])
    hf["torch_dtype"] = dtype
    (tmp / "config.json").write_text(json.dumps(hf, indent=2))
    tokenizer.save_pretrained(str(tmp))
    shutil.rmtree(directory, ignore_errors=True)
    os.rename(tmp, directory)
    return directory


def placements(parallel: ParallelConfig, rollout: RolloutConfig) -> tuple[GroupPlacement, GroupPlacement, RunPlacement | None]:
    """Actor and engine placements: placement groups on a GPU cluster (a layout that does
    not fit raises ``PlacementError`` before any actor starts), plain options on CPU."""
    nodes = alive_nodes()
    threads = cpu_threads(parallel, rollout, nodes)
    if not any(n.num_gpus for n in nodes):
        actors = actor_placement(parallel, torch_threads=threads)
        return actors, engine_placement(rollout, parallel, torch_threads=threads), None
    placed = place_on_gpus(plan_gpu_placement(parallel, rollout, nodes), torch_threads=threads)
    return placed.actor, placed.engines, placed


def build_run(config: RunConfig, *, checked: Preflight | None = None, warm: WarmWorkers | None = None) -> Run:
    """Every component of the run, in the order the module docstring gives (``checked``: the
    pre-flight's result, when the caller ran it already; ``warm``: actor ranks and engines
    kept from this process's earlier runs, see ``loop.warm``)."""
    run_dir = config.run_dir
    checkpoint_dir = run_dir / "checkpoints"
    # Cheap and strict first: every path, name, row and the checkpoint to resume from are
    # checked before any process starts (``preflight``; ``--dry-run`` runs the same).
    checked = checked or preflight(config)
    train_rows, eval_rows, encoder = checked.train_rows, checked.eval_rows, checked.encoder
    prompts = PromptSource(
        train_rows, eval_rows, encoder=encoder, seed=config.trainer.seed, shuffle=config.data.shuffle
    )  # fmt: skip

    engine = engine_class(config.rollout.engine)
    transport, backend = resolve_transport(config.rollout, engine, cuda=torch.cuda.is_available())
    lock = lock_run_dir(run_dir)  # one run per directory; created if missing
    try:
        save_resolved(config, run_dir)
        start_ray(run_dir)
        data = config.data
        rewards = RewardPool(checked.task.reward, num_workers=data.num_reward_workers, timeout_s=data.reward_timeout_s,
                             memory_mb=data.reward_memory_mb or None, max_abs_score=data.max_abs_reward)  # fmt: skip
    except BaseException:
        lock.release()
        raise
    rewards.start()  # the workers start while the actor ranks and the engines do
    try:
        run = _build_components(config, checked, run_dir, checkpoint_dir, prompts, rewards, transport, backend, warm)
    except BaseException:
        rewards.close()
        lock.release()
        raise
    run.lock = lock
    return run


def start_ray(run_dir: Path) -> None:
    """Ray for the run: the cluster ``RAY_ADDRESS`` names (Slurm's), else a local one of the
    run's own, never one named by a file another cluster left (``address="local"``; Ray's
    default reads ``/tmp/ray/ray_current_cluster``, stale or someone else's). A local
    cluster that does not come up is started again (``cluster.local_ray``)."""
    if ray.is_initialized():  # the caller's (tests, notebooks)
        return
    address = os.environ.get("RAY_ADDRESS") or "local"
    if address == "local":
        start_local_ray(lambda: _init_ray(address, run_dir))
    else:
        _init_ray(address, run_dir)


def _init_ray(address: str, run_dir: Path) -> None:
    try:
        ray.init(
            address=address,
            include_dashboard=False,
            # A cluster of our own starts no idle Python workers ahead (cluster.local_ray).
            _system_config=LEAN_RAY_SYSTEM_CONFIG if address == "local" else None,
            log_to_driver=True,
            configure_logging=False,
            # Every worker of the job logs to RUN_DIR/logs (observability.run_log).
            runtime_env={
                "env_vars": {LOG_DIR_ENV: str((run_dir / "logs").resolve())},
                "worker_process_setup_hook": "megatron_rl.observability.run_log.setup_worker_logging",
            },
        )
    except ConnectionError as e:
        if address == "local":
            raise
        raise RayClusterError(f"cannot join the Ray cluster at {address} (RAY_ADDRESS): {str(e).splitlines()[0]}; "
                              "start it, fix the address, or unset RAY_ADDRESS for a cluster of the run's own") from e


def _build_components(
    config: RunConfig, checked: Preflight, run_dir: Path, checkpoint_dir: Path, prompts: PromptSource,
    rewards: RewardPool, transport: str, backend: str, warm: WarmWorkers | None,
) -> Run:
    """Steps 2-4 of the module docstring: placement, actor ranks, engines, weight sync, sink."""
    resume_from, task, tokenizer, hf_config = checked.resume.path, checked.task, checked.tokenizer, checked.hf_config
    actor_group, engine_group, gpu_placement = placements(config.parallel, config.rollout)
    if warm is not None and gpu_placement is not None:  # a kept rank would die with the run's placement group
        raise ValueError("warm workers are for CPU runs: a GPU run's placement groups are removed with it")
    if gpu_placement is not None and config.rollout.engine_process == "driver":
        raise ConfigError("rollout.engine_process", "driver: the cluster has GPUs, and an engine in the driver's "
                          "process runs on CPU only (use ray_actor)")  # fmt: skip
    # A run that starts from a HF directory hands it to the engines unchanged; otherwise the
    # engines start from the config alone and the first sync brings the actor's initial
    # weights (_write_engine_config). Either way the actor ranks build their models while
    # the engines start, unless they share GPUs (a colocated engine sizes its memory from
    # what is free then).
    initial = config.model.initial_weights
    from_hf = initial is not None and is_hf_directory(initial)
    engine_dir = Path(initial) if from_hf else _write_engine_config(run_dir, hf_config, tokenizer,
                                                                       config.model.dtype or "float32")  # fmt: skip
    if warm is not None and not from_hf:
        engine_dir = warm.engine_dir(engine_dir)  # the same path for runs of the same model: kept engines fit
    overlap = not (gpu_placement is not None and config.rollout.placement == "colocated")
    spec = actor_spec(config)
    start_actors = warm.actor_group if warm else ActorGroup
    actors = start_actors(spec, actor_group, wait=not overlap)

    def start_pool() -> RolloutPool | LocalRolloutPool:
        if config.rollout.engine_process == "driver":
            return LocalRolloutPool(config.rollout, str(engine_dir), torch_threads=engine_group.torch_threads,
                                    weight_format=config.rollout.weight_dtype)  # fmt: skip
        lora_rank = config.actor.lora.rank if config.rollout.lora_sync == "adapter" else None
        start = warm.pool if warm else RolloutPool
        return start(config.rollout, str(engine_dir), placement=engine_group, weight_backend=backend,
                     weight_format=config.rollout.weight_dtype, lora_rank=lora_rank)  # fmt: skip

    pool = start_pool() if overlap else None
    if initial is not None:
        actors.load_initial_weights(initial)
    pool = pool or start_pool()
    weight_sync = WeightSync(actors, pool, config.rollout, transport=transport, backend=backend)
    write_placement(
        run_dir / "placement.json",
        ray_scheduling=config.parallel.ray_scheduling,
        actor_nodes=actors.node_ids(),
        engine_nodes=pool.node_ids(),
        layout=gpu_placement.layout if gpu_placement else None,
    )
    sink = MetricsSink(
        run_dir,
        wandb_mode=config.logging.wandb_mode,
        project=config.logging.wandb_project,
        run_name=config.logging.run_name,
        config=to_dict(config),
    )
    return Run(
        config=config,
        checkpoint_dir=checkpoint_dir,
        resume_from=resume_from,
        task=task,
        prompts=prompts,
        actors=actors,
        pool=pool,
        weight_sync=weight_sync,
        rewards=rewards,
        sink=sink,
        placement=gpu_placement,
        engines_await_weights=not from_hf,
        warm=warm,
    )
