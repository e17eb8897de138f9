"""Actor checkpoints: megatron ``dist_checkpointing`` of model + optimizer, plus RNG and counters.

Layout of ``<dir>`` (a megatron-core ``torch_dist`` checkpoint with extras)::

    .metadata, __*_*.distcp, common.pt, metadata.json   model + optimizer (dist_checkpointing)
    actor_state.json      counters, Adam step, LR-scheduler state, Adam's betas/eps, layout
    rng/rank<r>.pt        per-rank RNG states (Python, NumPy, torch, megatron's tracker),
                          tensors and numbers only: loaded with ``weights_only=True``
    hf_config/            config.json (+ generation config, tokenizer files when known)
    manifest.json         size and SHA-256 of every other file (written last)

and ``<dir>/../latest`` holds the name of the newest checkpoint directory
(:mod:`megatron_rl.storage.checkpoints` reads and checks all of this on the driver).

Before anything is written, every rank checks its parameters: a NaN/inf, or weights so
large that their float32 sum of squares overflows (a diverged update, e.g. at
``lr=1e30``: the next forward pass cannot be finite), raise :class:`NonFiniteWeightsError`
and the checkpoint is not written, so ``latest`` keeps naming the last good one.

Atomicity and durability: every rank writes into the temporary sibling
``<parent>/.<name>.tmp``; after a barrier the ranks hash (and fsync) the files between
them and global rank 0 writes the manifest, fsyncs the directories, renames the
checkpoint to ``<dir>`` (replacing an older ``<dir>``), fsyncs the parent and rewrites
``latest`` durably, so a crash or power cut leaves either the old or the new checkpoint
and pointer, never a partial one.

Model weights are stored TP/PP-independently (full tensors, layers stacked), so they
load at any TP/PP and ``megatron-rl convert mcore-to-hf`` exports them. A LoRA actor whose
frozen base came from a file writes its adapters alone (``adapters_only``; ``actor_state.json``
names the base under ``base_weights``), and such a checkpoint loads only over that base.

Optimizer state of megatron's plain optimizer (``actor.use_distributed_optimizer: false``):
per-parameter state, identical on every DP rank, recorded as ``replicated``; it loads at
the same TP/PP (any DP).

Optimizer state of the DistributedOptimizer, two formats:

* ``dp_reshardable`` (default, Megatron-LM's default): each rank writes its own buffer
  shards, no gathering. Reshards across DP only; loaded at another TP or PP, the
  weights, LR schedule and counters are restored and the Adam moments start fresh (a
  warning says so).
* ``fully_reshardable``: gathered to DP rank 0 on save into per-parameter tensors;
  loads at any TP/PP/DP (tested: TP=2 -> TP=1 x PP=2 resumes like not stopping).
  Costs a gather of the optimizer state of each model-parallel shard on save.

A checkpoint's optimizer state loads only into the kind of optimizer that wrote it
(distributed or not); into the other kind, weights, LR schedule and counters load and
Adam starts fresh, with a warning (megatron's two kinds name their state differently).

Two megatron-core 0.16.1 issues of the torch-AdamW path (CPU, no TE/Apex) are handled
here without patching: a fresh optimizer has no per-parameter state yet, so it cannot
describe what it loads (``init_adam_state`` allocates exactly what torch's first step
would), and ``fully_reshardable`` loading trips over the ``step`` state key
(``_load_optimizer_state`` calls megatron's two load halves with ``step`` held out).
The Adam step count itself is written to ``actor_state.json`` and restored into
separate per-parameter tensors: megatron's loader hands every parameter the SAME
tensor, which torch's AdamW would then increment once per parameter per step.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from megatron_rl.actor.checkpoint.rng import load_rng_file, rng_state, set_rng_state
from megatron_rl.actor.compat import cpu_shim
from megatron_rl.actor.launch import ProcessGroups
from megatron_rl.actor.optimizer import (
    adam_settings,
    adam_step,
    chained,
    init_adam_state,
    is_distributed,
    load_optimizer_state,
    set_adam_step,
)
from megatron_rl.storage.checkpoints import (
    BASE_WEIGHTS_KEY,
    LATEST_FILE,
    STATE_FILE,
    CheckpointError,
    checkpoint_files,
    file_digest,
    read_latest,
    write_latest,
    write_manifest,
)
from megatron_rl.storage.durable import DiskFullError, disk_full, fsync_dir, fsync_file

__all__ = [
    "OPTIMIZER_SHARDING",
    "STATE_FILE",
    "LATEST_FILE",
    "HF_CONFIG_SUBDIR",
    "resolve_checkpoint_dir",
    "save_checkpoint",
    "load_checkpoint",
    "adam_step",
    "set_adam_step",
    "init_adam_state",
    "check_finite_parameters",
    "NonFiniteWeightsError",
]

OPTIMIZER_SHARDING = "dp_reshardable"
"""Default DistributedOptimizer checkpoint format (Megatron-LM's default too)."""
OptimizerSharding = Literal["dp_reshardable", "fully_reshardable"]
HF_CONFIG_SUBDIR = "hf_config"
_FORMAT = "megatron_rl.actor/1"
_MODEL_RESHARDABLE = ("fully_reshardable",)  # optimizer formats that load at another TP/PP
REPLICATED = "replicated"
"""The recorded format of the plain (not distributed) optimizer's state."""


class NonFiniteWeightsError(RuntimeError):
    """The parameters are not finite (or overflow float32); the checkpoint was not written."""


def resolve_checkpoint_dir(path: str | Path) -> Path:
    """``path`` itself if it is a checkpoint, else the one named by ``path/latest``."""
    path = Path(path)
    if (path / "metadata.json").is_file():
        return path
    try:
        target = read_latest(path)  # refuses a pointer leading outside ``path``
    except CheckpointError as e:
        raise FileNotFoundError(str(e)) from None
    if target is not None:
        if (target / "metadata.json").is_file():
            return target
        raise FileNotFoundError(f"{path / LATEST_FILE} names {target}, which is not a checkpoint")
    raise FileNotFoundError(f"no checkpoint at {path} (no metadata.json and no '{LATEST_FILE}' pointer)")


def check_finite_parameters(model: torch.nn.Module) -> None:
    """Raise :class:`NonFiniteWeightsError` on every rank unless every rank's parameters are
    finite and their float32 sum of squares does not overflow.

    The second test catches a destroyed model whose weights are still technically finite
    (``|w|`` around 1e19 or more, e.g. after an update at ``lr=1e30``): no forward pass
    through such weights is finite, so it is no "last good" checkpoint. Collective.
    """
    params = [p for p in model.parameters()]
    device = params[0].device if params else torch.device("cpu")
    bad = torch.zeros(1, dtype=torch.float32, device=device)
    with torch.no_grad():
        for p in params:
            # Summed in float32 chunks (at most 64 MiB of temporaries), never rescaled: the
            # overflow is the point.
            total = torch.zeros((), dtype=torch.float32, device=p.device)
            for chunk in p.detach().reshape(-1).split(1 << 24):
                total += chunk.float().square().sum()
            if not torch.isfinite(total):
                bad.fill_(1.0)
                break
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    if bad.item() > 0:
        raise NonFiniteWeightsError(
            "the model's parameters are not finite, or so large that their float32 sum of squares "
            "overflows (a diverged update): the checkpoint was not written"
        )


def _hash_and_sync(directory: Path, world_size: int, rank: int) -> dict[str, str]:
    """SHA-256 of every file of ``directory``, the ranks sharing the work (each also fsyncs
    what it hashes); every rank returns the whole ``{relative path: digest}``. Collective."""
    names = checkpoint_files(directory)
    mine = {}
    for name in names[rank::world_size]:
        fsync_file(directory / name)
        mine[name] = file_digest(directory / name)
    gathered: list[dict[str, str] | None] = [None] * world_size
    dist.all_gather_object(gathered, mine)
    return {k: v for part in gathered for k, v in (part or {}).items()}


def save_checkpoint(
    directory: str | Path,
    *,
    model: torch.nn.Module,
    optimizer,
    groups: ProcessGroups,
    actor_state: Mapping[str, Any],
    hf_config: Mapping[str, Any],
    hf_source_dir: Path | None = None,
    optimizer_sharding: OptimizerSharding = OPTIMIZER_SHARDING,
    adapters_only: bool = False,
) -> Path:
    """Write a checkpoint of ``model`` (the unwrapped GPTModel) and ``optimizer`` to ``directory``.

    ``adapters_only``: of the model, only its LoRA adapters (the frozen base stays where it
    was loaded from; ``actor_state`` then names it under ``base_weights``).

    Collective over the whole world (barriers, dist_checkpointing). ``actor_state`` is
    written to ``actor_state.json`` by global rank 0 (JSON-serialisable values). Returns
    the final directory. Raises :class:`NonFiniteWeightsError` (on every rank, nothing
    written) when the parameters fail :func:`check_finite_parameters`, and
    :class:`~megatron_rl.storage.durable.DiskFullError` (the partial directory removed)
    when the file system fills up.
    """

    if optimizer_sharding not in ("dp_reshardable", "fully_reshardable"):
        raise ValueError(
            f"optimizer_sharding must be 'dp_reshardable' or 'fully_reshardable', got {optimizer_sharding!r}"
        )
    # The format actor_state.json records (None: no optimizer state saved).
    recorded = None if optimizer is None else optimizer_sharding if is_distributed(optimizer) else REPLICATED
    if recorded == REPLICATED and optimizer_sharding == "fully_reshardable":
        raise ValueError("optimizer_sharding 'fully_reshardable' is a format of the distributed optimizer")
    check_finite_parameters(model)
    final = Path(directory).absolute()
    tmp = final.parent / f".{final.name}.tmp"
    try:
        return _write(final, tmp, model=model, optimizer=optimizer, groups=groups, actor_state=actor_state,
                      hf_config=hf_config, hf_source_dir=hf_source_dir, optimizer_sharding=optimizer_sharding,
                      recorded=recorded, adapters_only=adapters_only)  # fmt: skip
    except BaseException as e:  # torch's CheckpointException is a BaseException
        # A full file system rarely says so: torch's writer reports a short write as
        # "unexpected pos ..."; so the free space decides too. The partial directory goes.
        if isinstance(e, (KeyboardInterrupt, SystemExit)) or not (disk_full(e) or _nearly_full(final.parent)):
            raise
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise DiskFullError(final.parent, f"the checkpoint {final.name}") from e


_NEARLY_FULL_BYTES = 1 << 20
"""Free bytes below which a failed checkpoint write is taken for a full file system."""


def _nearly_full(path: Path) -> bool:
    try:
        return shutil.disk_usage(path).free < _NEARLY_FULL_BYTES
    except OSError:
        return False


def _write(final: Path, tmp: Path, *, model, optimizer, groups, actor_state, hf_config, hf_source_dir,
           optimizer_sharding, recorded, adapters_only) -> Path:  # fmt: skip
    """The collective write of :func:`save_checkpoint` (``tmp``, then renamed to ``final``)."""
    from megatron.core import dist_checkpointing

    rank = dist.get_rank()
    if rank == 0:
        final.parent.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)  # left over by a crashed save
        tmp.mkdir(parents=True)  # empty: megatron warns about a non-empty target
    dist.barrier()

    metadata = {"distrib_optim_sharding_type": optimizer_sharding}
    with cpu_shim.cuda_to_cpu():
        model_sd = model.sharded_state_dict()
        if adapters_only:  # the optimizer holds the adapters alone, so its state maps onto these
            from megatron_rl.models.lora import ADAPTER_SUFFIXES

            model_sd = {k: v for k, v in model_sd.items() if k.endswith(ADAPTER_SUFFIXES)}
        state = {"model": model_sd}
        if optimizer is not None:
            state["optimizer"] = optimizer.sharded_state_dict(model_sd, metadata=metadata)
        dist_checkpointing.save(state, str(tmp))
    (tmp / "rng").mkdir(exist_ok=True)
    torch.save({"layout": _layout(groups), "state": rng_state()}, tmp / "rng" / f"rank{rank}.pt")
    dist.barrier()
    if rank == 0:
        record = {
            "format": _FORMAT,
            "layout": _layout(groups),
            **({} if recorded is None else {"optimizer_sharding": recorded}),
            **({} if optimizer is None else {"optimizer_parts": len(chained(optimizer))}),
            **adam_settings(optimizer),
            **actor_state,
        }
        (tmp / STATE_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        cfg_dir = tmp / HF_CONFIG_SUBDIR
        cfg_dir.mkdir()
        if hf_source_dir is not None:
            from megatron_rl.models.hf_io import copy_aux_files

            copy_aux_files(hf_source_dir, cfg_dir)
        (cfg_dir / "config.json").write_text(json.dumps(dict(hf_config), indent=2, sort_keys=True) + "\n")
    dist.barrier()
    digests = _hash_and_sync(tmp, dist.get_world_size(), rank)
    if rank == 0:
        write_manifest(tmp, digests)
        for sub in (tmp / "rng", tmp / HF_CONFIG_SUBDIR, tmp):
            fsync_dir(sub)
        old = final.parent / f".{final.name}.old"
        if final.exists():
            if old.exists():
                shutil.rmtree(old)
            os.rename(final, old)
        os.rename(tmp, final)
        fsync_dir(final.parent)
        if old.exists():
            shutil.rmtree(old)
        write_latest(final.parent, final.name)
    dist.barrier()
    return final


def _layout(groups: ProcessGroups) -> dict[str, int]:
    return {"tp": groups.tp_size, "pp": groups.pp_size, "dp": groups.dp_size, "ep": groups.ep_size,
            "etp": groups.etp_size}  # fmt: skip


def _full_layout(layout: dict[str, int]) -> dict[str, int]:
    """A recorded layout with the fields older checkpoints lack: EP 1 and expert TP = TP
    (checkpoints from before expert parallelism and before a separate expert TP size)."""
    return {"ep": 1, "etp": layout["tp"], **layout}


def _model_layout(layout: dict[str, int]) -> tuple[int, int, int, int]:
    """``(TP, PP, EP, ETP)`` of a recorded layout."""
    full = _full_layout(layout)
    return full["tp"], full["pp"], full["ep"], full["etp"]


def load_checkpoint(
    directory: str | Path,
    *,
    model: torch.nn.Module,
    optimizer,
    groups: ProcessGroups,
    load_optimizer: bool | None = None,
    load_rng: bool = True,
    base: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Load a checkpoint (or ``directory/latest``) into ``model`` and ``optimizer``.

    An adapter-only LoRA checkpoint (``base_weights`` in its ``actor_state.json``) loads
    its adapters only, over the base weights the model holds already: ``base`` (their
    ``{"path", "fingerprint"}``) must be the ones it records, else ``ValueError`` naming both.

    ``load_optimizer``: ``None`` loads the optimizer state when the checkpoint has one
    that fits (written at this TP/PP, or ``fully_reshardable``; warns and skips
    otherwise); ``True`` requires it;
    ``False`` loads weights only. A weights-only checkpoint (e.g. from ``megatron-rl
    convert hf-to-mcore``) loads too. RNG states are restored when the checkpoint was
    written at the same TP/PP/DP. Returns the saved ``actor_state.json`` content
    (``{}`` for a checkpoint without one) plus ``"loaded_optimizer": bool``.
    Collective over the whole world.
    """
    from megatron.core import dist_checkpointing

    path = resolve_checkpoint_dir(directory)
    record = json.loads((path / STATE_FILE).read_text()) if (path / STATE_FILE).is_file() else {}
    saved_layout = record.get("layout")
    here = _layout(groups)
    sharding = record.get("optimizer_sharding")  # None: no optimizer state saved
    same_model_layout = saved_layout is not None and _model_layout(saved_layout) == _model_layout(here)
    why_not = None  # why this optimizer cannot take the saved state
    saved_distributed = sharding != REPLICATED
    if sharding is not None and optimizer is not None and saved_distributed != is_distributed(optimizer):
        kind = {True: "distributed", False: "plain"}
        why_not = (
            f"it was written by the {kind[saved_distributed]} optimizer and this actor uses the "
            f"{kind[not saved_distributed]} one (actor.use_distributed_optimizer)"
        )
    elif sharding is not None and optimizer is not None and record.get("optimizer_parts", 1) != len(chained(optimizer)):
        # megatron keeps expert parameters in a second optimizer at expert parallelism > 1
        # (a ChainedOptimizer, whose state keys carry the part): EP 1 <-> EP > 1 renames them.
        why_not = (
            f"it was written by a megatron optimizer of {record.get('optimizer_parts', 1)} part(s) and this actor's "
            f"has {len(chained(optimizer))} (expert parallelism 1 and > 1 keep the expert parameters' state apart "
            "differently)"
        )
    elif sharding is not None and not (same_model_layout or sharding in _MODEL_RESHARDABLE):
        why_not = (
            "it was written at TP={} PP={} EP={} ETP={} and is '{}', which does not reshard to TP={} PP={} EP={} "
            "ETP={}".format(
                *_model_layout(saved_layout), sharding, *_model_layout(here)
            )
        )
    from megatron_rl.models.lora import ADAPTER_SUFFIXES

    with cpu_shim.cuda_to_cpu():
        model_sd = model.sharded_state_dict()
    adapters = sorted(k for k in model_sd if k.endswith(ADAPTER_SUFFIXES))
    base_only = bool(adapters) and not record.get("lora")
    recorded_base = record.get(BASE_WEIGHTS_KEY)
    if recorded_base is not None and adapters:
        if base is None or base["fingerprint"] != recorded_base["fingerprint"]:
            held = "no base weights loaded" if base is None else f"the base weights of {base['path']}"
            raise ValueError(
                f"checkpoint {path} holds LoRA adapters only, trained over the base weights of "
                f"{recorded_base['path']} (fingerprint {recorded_base['fingerprint'][:12]}); this model holds {held}: "
                "load those first (model.checkpoint / model.hf_config)"
            )
        model_sd = {k: model_sd[k] for k in adapters}
    if record.get("lora") and not adapters:
        raise ValueError(f"checkpoint {path} holds LoRA adapters ({record['lora']}) and this model has none "
                         "(set actor.lora as the run that wrote it did)")  # fmt: skip
    if base_only:
        # A base model's weights (a converted or full-parameter checkpoint) into a LoRA model:
        # the adapters keep their initialisation, and the saved optimizer state (if any) is
        # of other parameters.
        for key in adapters:
            model_sd.pop(key)
        why_not = why_not or "it holds no LoRA adapters (a base model's weights): this model's adapters start fresh"
    if load_optimizer is None:
        load_optimizer = optimizer is not None and sharding is not None and why_not is None
        if sharding is not None and why_not is not None and dist.get_rank() == 0:
            warnings.warn(
                f"loading weights only from checkpoint {path}; its optimizer state does not fit: {why_not}",
                stacklevel=2,
            )
    elif load_optimizer and (optimizer is None or sharding is None or why_not is not None):
        reason = why_not or ("no optimizer was given" if optimizer is None else "it has none")
        raise ValueError(f"cannot load optimizer state from {path}: {reason}")

    with cpu_shim.cuda_to_cpu():
        state = {"model": model_sd}
        if load_optimizer:
            init_adam_state(optimizer)
            state["optimizer"] = optimizer.sharded_state_dict(
                model.sharded_state_dict(),
                is_loading=True,
                metadata={"distrib_optim_sharding_type": sharding},
            )
    with cpu_shim.cuda_to_cpu(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*load_state_dict.*deprecated", category=FutureWarning)
        loaded = dist_checkpointing.load(state, str(path))
    missing, unexpected = model.load_state_dict(loaded["model"], strict=False)
    missing = [k for k in missing if not (base_only and k.endswith(ADAPTER_SUFFIXES))
               and not (recorded_base is not None and not k.endswith(ADAPTER_SUFFIXES))]  # fmt: skip
    if missing or unexpected:
        raise RuntimeError(f"checkpoint {path} does not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if optimizer is not None:
        with torch.no_grad(), cpu_shim.cuda_to_cpu():
            if load_optimizer:
                # fp32 DistributedOptimizer loads copy into views of requires-grad params.
                load_optimizer_state(optimizer, loaded["optimizer"])
                # DistributedOptimizer.load_state_dict gives every parameter the SAME step
                # tensor, which torch's AdamW then increments once per parameter per step:
                # restore the saved count into separate tensors.
                step = record.get("adam_step")
                if step is None:
                    step = adam_step(optimizer)
                if step is not None:
                    set_adam_step(optimizer, step)
            else:
                # Master weights (fp32 copies of bf16 params) must follow the new weights.
                optimizer.reload_model_params()
    rng_file = path / "rng" / f"rank{dist.get_rank()}.pt"
    if load_rng and saved_layout is not None and _full_layout(saved_layout) == here and rng_file.is_file():
        rng = load_rng_file(rng_file)
        if rng is not None:
            set_rng_state(rng)
    dist.barrier()
    return {**record, "loaded_optimizer": bool(load_optimizer), "loaded_as_base": base_only}
