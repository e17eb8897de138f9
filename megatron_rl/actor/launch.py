"""Process start-up for actor ranks: torch.distributed, megatron parallel state, CPU shim, seeds.

One process per rank, started by ``torchrun``, ``torch.multiprocessing.spawn`` (tests)
or a Ray actor (the trainer). The launcher sets the usual environment
(``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``) or calls
:func:`init_process_group` with explicit values.

Rank layout is megatron-core's default order ``tp-cp-ep-dp-pp``: tensor-parallel
ranks are adjacent, pipeline stages are farthest apart. With 4 ranks, TP=2, PP=2:
ranks {0,1} are stage 0, {2,3} stage 1, and the TP groups are {0,1}, {2,3}.

Scripts that save dist-checkpoints must keep ``init_process_group`` under an
``if __name__ == "__main__":`` guard: megatron's checkpoint writer starts helper
processes with the ``spawn`` method, which re-import ``__main__``.
"""

from __future__ import annotations

import datetime
import gc
import os
import random
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_rl.actor.compat import cpu_shim
from megatron_rl.config.parallel import ParallelConfig

__all__ = [
    "ProcessGroups",
    "init_process_group",
    "initialize_parallel",
    "initialize_parallel_from",
    "destroy_parallel",
    "destroy_process_groups",
    "set_seed",
]


@dataclass(frozen=True, kw_only=True)
class ProcessGroups:
    """The process groups an actor rank uses, with its coordinates in each.

    Passed explicitly to every function that runs a collective, so none of them reads
    megatron's global parallel state. Built by :func:`initialize_parallel`.
    """

    tp: dist.ProcessGroup
    """Tensor-parallel group: ranks holding shards of the same layers."""
    pp: dist.ProcessGroup
    """Pipeline-parallel group: one rank per stage, same TP and DP coordinates."""
    dp: dist.ProcessGroup
    """Data-parallel group: replicas of the same shards (gradient reduction, metrics)."""
    tp_rank: int
    """This rank's index in ``tp`` (which vocabulary / head shard it holds)."""
    tp_size: int
    """Tensor-parallel size."""
    pp_rank: int
    """Pipeline stage of this rank (0 = embedding side)."""
    pp_size: int
    """Number of pipeline stages."""
    dp_rank: int
    """Data-parallel replica index (which rows of a batch this rank trains on)."""
    dp_size: int
    """Number of data-parallel replicas (world / (TP * PP))."""
    pp_global_ranks: tuple[int, ...]
    """Global rank of each stage of this rank's PP group, stage 0 first."""
    ep: dist.ProcessGroup
    """Expert-parallel group: the ranks over which each MoE layer's experts are split (one
    rank alone for dense models and EP = 1)."""
    ep_rank: int
    """This rank's index in ``ep``: it holds experts ``ep_rank * E / ep_size`` onwards."""
    ep_size: int
    """Expert-parallel size."""
    etp: dist.ProcessGroup
    """Expert tensor-parallel group: the ranks over which each expert's weights are split
    (``parallel.expert_tensor_parallel_size``; the TP ranks when it is unset)."""
    etp_rank: int
    """This rank's index in ``etp`` (which slice of its experts' width it holds)."""
    etp_size: int
    """Expert tensor-parallel size."""
    edp_rank: int
    """Expert data-parallel replica index: ranks with the same EP and expert TP coordinates
    hold the same expert shards (``world / (ETP * EP * PP)`` replicas). Equals ``dp_rank``
    when ETP = TP and EP = 1."""

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def last_stage_global_rank(self) -> int:
        """Global rank of the last stage of this rank's pipeline (the source of outputs)."""
        return self.pp_global_ranks[-1]


def init_process_group(
    *,
    backend: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    timeout_minutes: int = 30,
) -> None:
    """Initialise torch.distributed once per process (a no-op when already initialised).

    ``backend=None`` picks ``nccl`` when CUDA is available, else ``gloo``. Rank and world
    size default to the ``RANK`` / ``WORLD_SIZE`` environment variables (env:// init); a
    world of one without ``MASTER_PORT`` uses an in-memory store instead.
    On CUDA the device is set from ``LOCAL_RANK``.
    """
    if dist.is_initialized():
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    kwargs: dict = {}
    if rank is not None:
        kwargs["rank"] = rank
    if world_size is not None:
        kwargs["world_size"] = world_size
    alone = (world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))) == 1
    if alone and "MASTER_PORT" not in os.environ:
        # One process and no rendezvous given (a benchmark, a script): an in-memory store.
        # A TCP port picked as free can be taken by another process before the store binds it.
        kwargs.update(store=dist.HashStore(), rank=0, world_size=1)
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=timeout_minutes), **kwargs)


def initialize_parallel(
    *,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
    seed: int = 1234,
) -> ProcessGroups:
    """Set up megatron's parallel state (TP/PP/DP, and EP/ETP for the expert layers) and the
    RNGs on an initialised process group.

    Applies the CPU shim first when CUDA is unavailable (see ``cpu_shim``). The same layout
    again reuses the existing groups (an actor built before keeps working); another layout
    re-initialises the parallel state (:func:`destroy_parallel` first, so the old layout's
    groups and their threads go), so one process can build actors of several layouts one
    after the other (the tests do; an actor of the old layout is unusable after that). DP = world / (TP * PP).

    Seeds: Python, NumPy and torch get ``seed + 100 * pp_rank`` (Megatron-LM's convention:
    stages draw different dropout masks, TP ranks of a stage the same CPU stream, which
    ``use_cpu_initialization`` needs to build identical master weights);
    ``model_parallel_cuda_manual_seed`` derives the tensor-parallel region streams.
    """
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call init_process_group() first")
    cpu_shim.apply()
    from megatron.core import parallel_state as ps

    world = dist.get_world_size()
    model_parallel = tensor_model_parallel_size * pipeline_model_parallel_size
    if world % model_parallel:
        raise ValueError(f"world size {world} is not a multiple of TP * PP = {model_parallel}")
    layout = (tensor_model_parallel_size, pipeline_model_parallel_size, expert_model_parallel_size,
              expert_tensor_parallel_size, world)  # fmt: skip
    if _LAYOUT != [layout] or not ps.model_parallel_is_initialized():
        destroy_parallel()
        _GROUPS_BEFORE[:] = _live_groups()
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tensor_model_parallel_size,
            pipeline_model_parallel_size=pipeline_model_parallel_size,
            expert_model_parallel_size=expert_model_parallel_size,
            expert_tensor_parallel_size=expert_tensor_parallel_size,
        )
        _LAYOUT[:] = [layout]
    groups = ProcessGroups(
        tp=ps.get_tensor_model_parallel_group(),
        pp=ps.get_pipeline_model_parallel_group(),
        dp=ps.get_data_parallel_group(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        pp_global_ranks=tuple(dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())),
        ep=ps.get_expert_model_parallel_group(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        ep_size=ps.get_expert_model_parallel_world_size(),
        etp=ps.get_expert_tensor_parallel_group(),
        etp_rank=ps.get_expert_tensor_parallel_rank(),
        etp_size=ps.get_expert_tensor_parallel_world_size(),
        edp_rank=ps.get_expert_data_parallel_rank(),
    )
    set_seed(seed, pp_rank=groups.pp_rank)
    return groups


def initialize_parallel_from(parallel: ParallelConfig, *, seed: int) -> ProcessGroups:
    """:func:`initialize_parallel` at the sizes of the run's ``parallel`` section."""
    return initialize_parallel(
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
        seed=seed,
    )


def set_seed(seed: int, *, pp_rank: int = 0) -> None:
    """Seed Python, NumPy, torch and megatron's model-parallel RNG tracker (see :func:`initialize_parallel`)."""
    import numpy as np
    from megatron.core import tensor_parallel

    stage_seed = seed + 100 * pp_rank
    random.seed(stage_seed)
    np.random.seed(stage_seed % 2**32)
    torch.manual_seed(stage_seed)
    with cpu_shim.cuda_to_cpu():
        tensor_parallel.model_parallel_cuda_manual_seed(stage_seed)


_GROUPS_BEFORE: list[dist.ProcessGroup] = []
"""The process groups that existed before :func:`initialize_parallel` set the current
layout up: every later one (megatron's, and those its distributed optimizer and
checkpointing create for the layout) is destroyed by :func:`destroy_parallel`."""
_LAYOUT: list[tuple[int, int, int, int | None, int]] = []
"""``(TP, PP, EP, ETP, world)`` of the parallel state :func:`initialize_parallel` set up, if any."""


def _live_groups() -> list[dist.ProcessGroup]:
    """Every process group torch.distributed holds but the default one (megatron-core reads
    the same registry, ``distributed_c10d._world.pg_map``, in its own teardown)."""
    world = dist.GroupMember.WORLD
    return [g for g in dist.distributed_c10d._world.pg_map if g is not world]


def destroy_parallel() -> None:
    """Tear down megatron's parallel state and destroy the process groups made for it (the
    default torch.distributed group, and groups that predate the layout, stay).

    ``destroy_model_parallel`` only drops megatron's references (its gloo copies of the DP
    groups aside): the groups themselves stay registered with torch.distributed, and each
    gloo group keeps its threads while anything references it. Megatron's modules hold
    their groups in reference cycles, so the models of the old layout (unusable now) are
    collected here too. A process that re-initialised the parallel state for several
    layouts grew by ~50 threads per layout and rank without this.
    """
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    # Its teardown leaves some globals set (``_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP``
    # and its gloo twin, in 0.16 to 0.19): they would keep two groups' threads alive until
    # the next layout, or into interpreter exit, where a live gloo group's threads can abort
    # the process (SIGABRT, "terminate called without an active exception").
    for name, value in list(vars(ps).items()):
        if isinstance(value, dist.ProcessGroup):
            setattr(ps, name, None)
    if _LAYOUT:
        keep = set(_GROUPS_BEFORE)
        for group in _live_groups():
            if group not in keep:
                dist.destroy_process_group(group)
    _LAYOUT.clear()
    gc.collect()


def destroy_process_groups() -> None:
    """End this rank's part in the job, the last thing before the process exits: the
    layout's groups (:func:`destroy_parallel`), then, once every rank is here, the default
    group.

    A gloo group still alive at interpreter exit can abort the process after its work is
    done (SIGABRT, "terminate called without an active exception": its threads outlive the
    interpreter), so a job that exits with groups alive fails a return-code check now and
    then. Objects that still reference a group (a model in the caller's frame) free it when
    they go, while the interpreter is alive.
    """
    destroy_parallel()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
