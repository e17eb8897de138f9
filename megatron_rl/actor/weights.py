"""HF-named weights <-> a sharded actor: full tensors for weight sync, and HF initial weights.

Each rank holds the parameters of its pipeline stage, split across its TP group. To
produce the HF state dict:

1. Local parameter names are made global (local layer ``i`` of a stage -> its
   ``layer_number - 1``) and canonical (``canonical_mcore_name``: the names of the
   adapters' :class:`~megatron_rl.models.WeightUnit` s).
2. The stages agree once on who owns which unit (an all-gather of names over PP).
3. Unit by unit, in the adapter's HF order: the owning stage's TP ranks all-gather
   the shards (``partition_dim``; the SwiGLU ``linear_fc1`` holds ``[gate_r; up_r]`` per
   rank, so gates and ups are gathered separately), the full tensor is broadcast from
   the owning stage over the PP group, and the adapter's ``mcore_to_hf`` splits it
   into HF tensors (fused QKV -> q/k/v, [gate; up] -> gate/up, vocab padding stripped).

:func:`iter_hf_weights` yields the ``(hf_name, tensor)`` pairs one by one (what the
rollout pool's weight sync consumes); :func:`iter_hf_weight_buckets` yields the lists.
Every rank of a model-parallel group runs the same collectives and yields the same
tensors (every rank must consume the iterator to the end, in lockstep); DP replicas
work independently of each other. Tensors have the model's parameter dtype and device
and are copies, never views of live parameters.

:class:`HFWeightSource` wraps the stream for the weight-transfer senders (metadata up
front, tensors cast to the engines' dtype).

:func:`load_hf_weights` goes the other way (HF safetensors -> this rank's shards), for
``model.init: pretrained`` from a HF directory without a conversion step.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megatron_rl.actor.launch import ProcessGroups
from megatron_rl.models import DecoderAdapter, canonical_mcore_name
from megatron_rl.weight_sync.meta import TensorMeta

if TYPE_CHECKING:
    from megatron_rl.weight_sync.adapters import AdapterUpdate

__all__ = [
    "HFWeightSource",
    "global_parameters",
    "gather_tp_shards",
    "gather_tp_shards_to_first",
    "concat_tp_shards",
    "take_tp_shard",
    "iter_hf_weight_buckets",
    "iter_hf_weights",
    "load_hf_weights",
    "gather_adapters",
]

_LAYER_PREFIX = "decoder.layers."
# The SwiGLU fc1 of the dense MLP and of each expert (``mlp.experts.local_experts.<j>.linear_fc1``).
_GATED_FC1_SUFFIXES = ("linear_fc1.weight", "linear_fc1.bias")
_GROUPED_WEIGHT = re.compile(r"(linear_fc[12]\.(?:weight|bias))(\d+)")


def global_parameters(
    model: torch.nn.Module, adapter: DecoderAdapter | None = None, *, merge_adapters: bool = False
) -> dict[str, torch.nn.Parameter]:
    """``{canonical global name: parameter}`` of one pipeline stage's ``GPTModel``: its base
    model's parameters (a LoRA model's adapters are not among them).

    Layer names carry the global layer index (``layer_number - 1``), so stage 1 of a
    2-stage 4-layer model reports ``decoder.layers.2.*`` and ``decoder.layers.3.*``; expert
    names carry the global expert index (megatron's ``local_expert_indices`` of each
    layer's experts: expert parallel rank r of EP holds experts ``r * E / EP`` onwards as
    ``local_experts.0, 1, ...`` or, on the TE spec, ``weight0, 1, ...``). Names are then
    made canonical by ``adapter.canonical_mcore_name`` (the dense decoders' mapping when no
    adapter is given).

    ``merge_adapters``: an adapted linear's weight reads (``[name]``) as this rank's shard of
    ``W + (alpha / rank) B A`` (``models.lora``: computed on each read, so a weight sync
    holds one merged unit at a time), what the engines and HF exports get.
    """
    canonical = canonical_mcore_name if adapter is None else adapter.canonical_mcore_name
    layers = model.decoder.layers
    experts = {  # each MoE layer's ``experts.`` prefix -> its experts' global indices
        prefix + ".experts.": [int(i) for i in module.local_expert_indices]
        for prefix, module in model.named_modules()
        if hasattr(module, "local_expert_indices") and hasattr(module, "experts")
    }
    from megatron_rl.models.lora import ADAPTER_SUFFIXES

    # LoRA linears (models.lora): their adapter parameters are not base weights.
    adapted = {name: module for name, module in model.named_modules() if hasattr(module, "merged_weight")}
    adapter_params = {name + suffix for name in adapted for suffix in ADAPTER_SUFFIXES}
    out = _MergedAdapters() if merge_adapters else {}
    for name, param in model.named_parameters():
        if name in adapter_params:
            continue
        merged = adapted.get(name.removesuffix(".weight")) if merge_adapters and name.endswith(".weight") else None
        for prefix, indices in experts.items():
            if name.startswith(prefix):
                name = prefix + _global_expert_name(name[len(prefix) :], indices)
                break
        if name.startswith(_LAYER_PREFIX):
            local, _, rest = name[len(_LAYER_PREFIX) :].partition(".")
            name = f"{_LAYER_PREFIX}{layers[int(local)].layer_number - 1}.{rest}"
        out[canonical(name)] = param
        if merged is not None:
            out.merged[canonical(name)] = merged
    return out


class _MergedAdapters(dict):
    """:func:`global_parameters` with ``merge_adapters``: ``[name]`` of an adapted linear's
    weight gives its merged shard (``merged[name].merged_weight()``, a new tensor); the
    dict's own views (``items()``, ``values()``) give the stored parameters, which is what
    the ownership and dtype bookkeeping reads (no merge computed for them)."""

    def __init__(self) -> None:
        super().__init__()
        self.merged: dict[str, torch.nn.Module] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        module = self.merged.get(name)
        return super().__getitem__(name) if module is None else module.merged_weight()


def _global_expert_name(rest: str, indices: list[int]) -> str:
    """``local_experts.<l>.…`` (local spec) or ``linear_fc<k>.weight<l>`` (TE grouped GEMM),
    relative to a layer's ``mlp.experts.``, with local expert l renamed to global ``indices[l]``."""
    head, _, tail = rest.partition(".")
    if head == "local_experts":
        local, _, tail = tail.partition(".")
        return f"local_experts.{indices[int(local)]}.{tail}"
    match = _GROUPED_WEIGHT.fullmatch(rest)
    if match:
        return f"{match.group(1)}{indices[int(match.group(2))]}"
    return rest


def gather_tp_shards(
    name: str, param: torch.Tensor, *, tp_group: dist.ProcessGroup, tp_size: int, gated_linear_unit: bool
) -> torch.Tensor:
    """The full tensor of a (possibly) tensor-parallel parameter; a copy, never a view.

    Collective on ``tp_group`` (all-gather) when the parameter is TP-split
    (``tensor_model_parallel`` attribute, along ``partition_dim``); replicated
    parameters are copied locally.
    """
    tensor = param.detach()
    if tp_size == 1 or not getattr(param, "tensor_model_parallel", False):
        return tensor.clone()
    shards = [torch.empty_like(tensor) for _ in range(tp_size)]
    dist.all_gather(shards, tensor.contiguous(), group=tp_group)
    return concat_tp_shards(name, shards, dim=int(param.partition_dim), gated_linear_unit=gated_linear_unit)


def gather_tp_shards_to_first(
    name: str, param: torch.Tensor, *, tp_group: dist.ProcessGroup, tp_rank: int, tp_size: int, gated_linear_unit: bool
) -> torch.Tensor | None:
    """The full tensor of a (possibly) tensor-parallel parameter on rank 0 of ``tp_group``
    (a copy), ``None`` on its other ranks. ``tp_group`` is the TP group, or the expert TP
    group for an expert's weights.

    Collective on ``tp_group`` (a gather to its rank 0) when the parameter is TP-split:
    unlike :func:`gather_tp_shards`, only the receiving rank allocates the full tensor."""
    tensor = param.detach()
    if tp_size == 1 or not getattr(param, "tensor_model_parallel", False):
        return tensor.clone() if tp_rank == 0 else None
    first = dist.get_global_rank(tp_group, 0)
    if tp_rank != 0:
        dist.gather(tensor.contiguous(), None, dst=first, group=tp_group)
        return None
    shards = [torch.empty_like(tensor) for _ in range(tp_size)]
    dist.gather(tensor.contiguous(), shards, dst=first, group=tp_group)
    return concat_tp_shards(name, shards, dim=int(param.partition_dim), gated_linear_unit=gated_linear_unit)


def concat_tp_shards(name: str, shards: list[torch.Tensor], *, dim: int, gated_linear_unit: bool) -> torch.Tensor:
    """Join the TP shards of parameter ``name`` (rank order) into its full tensor.

    Shards concatenate along ``dim``, except the SwiGLU ``linear_fc1``: each rank holds
    ``[gate_r; up_r]`` and the full tensor is ``[gate_0 .. gate_n; up_0 .. up_n]``.
    """
    if gated_linear_unit and name.endswith(_GATED_FC1_SUFFIXES):
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=dim)


def _ownership(local: Mapping[str, torch.Tensor], groups: ProcessGroups) -> dict[str, tuple[int, torch.dtype]]:
    """``{canonical name: (owning stage, dtype)}``, agreed over the PP group (first stage wins)."""
    mine = {name: p.dtype for name, p in local.items()}
    if groups.pp_size == 1:
        return {name: (0, dtype) for name, dtype in mine.items()}
    everyone: list[Any] = [None] * groups.pp_size
    dist.all_gather_object(everyone, mine, group=groups.pp)
    owners: dict[str, tuple[int, torch.dtype]] = {}
    for stage, names in enumerate(everyone):
        for name, dtype in names.items():
            owners.setdefault(name, (stage, dtype))
    return owners


def iter_hf_weight_buckets(
    model: torch.nn.Module,
    *,
    adapter: DecoderAdapter,
    hf_config: Mapping[str, Any],
    padded_vocab_size: int,
    groups: ProcessGroups,
    gated_linear_unit: bool = True,
    bucket_bytes: int = 512 * 2**20,
    to_first_rank: bool = False,
    merge_adapters: bool = True,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield buckets ``[(hf_name, full tensor), ...]`` covering the whole HF state dict.

    A bucket closes once it holds at least ``bucket_bytes`` (so one large tensor may
    exceed it); the last bucket may be smaller. Order: the adapter's unit order
    (embedding, layers, final norm, lm_head).

    Collectives, per unit: by default an all-gather on ``groups.tp`` and a broadcast on
    ``groups.pp``, and every rank yields the same (each DP replica on its own). With
    ``to_first_rank`` only the first rank of the first replica (global rank 0, the one
    that sends a weight sync) receives full tensors: the owning stage's TP ranks gather to
    their TP rank 0, which sends the unit to stage 0 point to point; every other rank
    yields nothing, and the ranks of other DP replicas take part in nothing (they hold
    the same weights), except those of expert-data-parallel replica 0, which gather the
    experts they hold over the expert TP group and send them to rank 0 the same way. A
    sync then costs one unit's full tensor on the sending rank and nothing beyond its
    shards elsewhere. Without ``to_first_rank``, an expert's shards are all-gathered over
    ``groups.etp`` and the expert broadcast over ``groups.ep`` from the rank that holds it.

    A LoRA model's adapted weights are sent merged (``W + (alpha/r) B A``), or, without
    ``merge_adapters``, as the frozen base ``W`` (``rollout.lora_sync: adapter``: the engines
    take the adapters separately, :func:`gather_adapters`).
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    # Experts are laid out over their own groups (expert TP, EP, expert DP), which at EP > 1
    # or expert TP != TP cut across the dense DP replicas: expert-DP replica 0 sends them, and
    # its ranks in other dense replicas take part in expert units only.
    if to_first_rank and groups.dp_rank != 0 and groups.edp_rank != 0:
        return
    local = global_parameters(model, adapter, merge_adapters=merge_adapters)
    owners = _ownership(local, groups)
    units = adapter.weight_units(hf_config, padded_vocab_size=padded_vocab_size)
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    device = next(iter(local.values())).device
    for unit in units:
        split = unit.expert is not None
        # An expert may be held by another expert-parallel rank: the stage of its layer's router owns it.
        key = f"{_LAYER_PREFIX}{unit.layer}.mlp.router.weight" if split else unit.mcore_name
        if key not in owners:
            raise KeyError(f"no pipeline stage holds '{unit.mcore_name}' (model and HF config disagree?)")
        stage, dtype = owners[key]
        if split and to_first_rank:
            full = _expert_on_first_rank(unit, local, stage, dtype, device, groups, gated_linear_unit)
            if full is None:
                continue
        elif split:
            full = _expert_on_ep_group(unit, local, stage, dtype, device, groups, gated_linear_unit)
            if groups.pp_size > 1:
                dist.broadcast(full, src=groups.pp_global_ranks[stage], group=groups.pp)
        elif to_first_rank and groups.dp_rank != 0:
            continue  # a first-copy expert rank of another replica: dense units come from replica 0
        elif to_first_rank:
            full = _unit_on_first_rank(unit, local, stage, dtype, device, groups, gated_linear_unit)
            if full is None:
                continue
        else:
            if stage == groups.pp_rank:
                full = gather_tp_shards(unit.mcore_name, local[unit.mcore_name], tp_group=groups.tp,
                                        tp_size=groups.tp_size, gated_linear_unit=gated_linear_unit)  # fmt: skip
            else:
                full = torch.empty(unit.mcore_shape, dtype=dtype, device=device)
            if groups.pp_size > 1:
                dist.broadcast(full, src=groups.pp_global_ranks[stage], group=groups.pp)
        for name, tensor in adapter.mcore_to_hf(unit, full):
            if tensor.storage_offset() != 0 or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
                # A slice of `full` (gate/up halves, vocab rows without padding): give it
                # its own storage, so serialising it does not carry the rest along.
                tensor = tensor.clone(memory_format=torch.contiguous_format)
            bucket.append((name, tensor))
            size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def _expert_on_ep_group(
    unit: Any, local: Mapping[str, torch.Tensor], stage: int, dtype: torch.dtype, device: torch.device,
    groups: ProcessGroups, gated_linear_unit: bool,
) -> torch.Tensor:  # fmt: skip
    """Expert ``unit.expert``'s full tensor on every rank of the owning stage: the
    expert-parallel rank holding it (experts ``r * E / EP`` onwards on rank r) all-gathers
    its shards over the expert TP group, then broadcasts it over ``groups.ep``."""
    owner = _expert_owner(unit, groups)
    if stage != groups.pp_rank:
        return torch.empty(unit.mcore_shape, dtype=dtype, device=device)
    if groups.ep_rank == owner:
        full = gather_tp_shards(unit.mcore_name, local[unit.mcore_name], tp_group=groups.etp, tp_size=groups.etp_size,
                                gated_linear_unit=gated_linear_unit)  # fmt: skip
    else:
        full = torch.empty(unit.mcore_shape, dtype=dtype, device=device)
    if groups.ep_size > 1:
        dist.broadcast(full, src=dist.get_global_rank(groups.ep, owner), group=groups.ep)
    return full


def _expert_owner(unit: Any, groups: ProcessGroups) -> int:
    """The expert-parallel rank holding expert ``unit.expert`` (rank r: experts ``r * E / EP`` onwards)."""
    return unit.expert // (unit.num_experts // groups.ep_size)


def _expert_on_first_rank(
    unit: Any, local: Mapping[str, torch.Tensor], stage: int, dtype: torch.dtype, device: torch.device,
    groups: ProcessGroups, gated_linear_unit: bool,
) -> torch.Tensor | None:  # fmt: skip
    """Expert ``unit.expert``'s full tensor on global rank 0 (``None`` elsewhere): in
    expert-data-parallel replica 0, the expert-parallel rank holding it gathers its shards
    to its expert TP rank 0, which sends the tensor to rank 0 point to point (world group).
    Rank 0 (expert TP, EP and expert-DP rank 0) finds the sender as its own EP group's
    member ``owner`` moved to ``stage`` (pipeline stages are the outermost dimension of
    megatron's rank order, so a stage is a constant rank offset)."""
    owner = _expert_owner(unit, groups)
    rank = dist.get_rank()
    if stage == groups.pp_rank and groups.ep_rank == owner and groups.edp_rank == 0:
        full = gather_tp_shards_to_first(unit.mcore_name, local[unit.mcore_name], tp_group=groups.etp,
                                         tp_rank=groups.etp_rank, tp_size=groups.etp_size,
                                         gated_linear_unit=gated_linear_unit)  # fmt: skip
        if full is None or rank == 0:
            return full
        dist.send(full, dst=0)
        return None
    if rank != 0:
        return None
    source = dist.get_process_group_ranks(groups.ep)[owner] + groups.pp_global_ranks[stage] - groups.pp_global_ranks[0]
    full = torch.empty(unit.mcore_shape, dtype=dtype, device=device)
    dist.recv(full, src=source)
    return full


def _unit_on_first_rank(
    unit: Any, local: Mapping[str, torch.Tensor], stage: int, dtype: torch.dtype, device: torch.device,
    groups: ProcessGroups, gated_linear_unit: bool,
) -> torch.Tensor | None:  # fmt: skip
    """One unit's full tensor on global rank 0 (``None`` elsewhere): TP gather within the
    owning stage, then a point-to-point send to stage 0 over the TP-rank-0 ranks' PP group."""
    full = None
    if stage == groups.pp_rank:
        full = gather_tp_shards_to_first(unit.mcore_name, local[unit.mcore_name], tp_group=groups.tp,
                                         tp_rank=groups.tp_rank, tp_size=groups.tp_size,
                                         gated_linear_unit=gated_linear_unit)  # fmt: skip
        if stage != 0 and full is not None:
            dist.send(full, dst=groups.pp_global_ranks[0], group=groups.pp)
            full = None
    elif groups.pp_rank == 0 and groups.tp_rank == 0:
        full = torch.empty(unit.mcore_shape, dtype=dtype, device=device)
        dist.recv(full, src=groups.pp_global_ranks[stage], group=groups.pp)
    return full


def iter_hf_weights(
    model: torch.nn.Module, *, bucket_bytes: int = 512 * 2**20, **kwargs
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, full tensor)`` pairs of the whole HF state dict, one at a time.

    The flattened :func:`iter_hf_weight_buckets` (same arguments): units are gathered a
    bucket of at least ``bucket_bytes`` at a time, then handed out one by one, so at most
    about one bucket of full tensors is held ahead of the consumer. Every yielded tensor
    is a fresh copy that nothing reuses (safe to hand to ``ray.put`` without copying).
    """
    for bucket in iter_hf_weight_buckets(model, bucket_bytes=bucket_bytes, **kwargs):
        yield from bucket


def take_tp_shard(
    name: str, full: torch.Tensor, param: torch.Tensor, *, tp_rank: int, tp_size: int, gated_linear_unit: bool
) -> torch.Tensor:
    """This rank's TP shard of the full tensor ``full`` of ``param`` (inverse of :func:`gather_tp_shards`)."""
    if tp_size == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    if gated_linear_unit and name.endswith(_GATED_FC1_SUFFIXES):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank]], dim=0)
    return full.chunk(tp_size, dim=int(param.partition_dim))[tp_rank]


@torch.no_grad()
def load_hf_weights(
    model: torch.nn.Module,
    directory,
    *,
    adapter: DecoderAdapter,
    hf_config: Mapping[str, Any],
    padded_vocab_size: int,
    groups: ProcessGroups,
    gated_linear_unit: bool = True,
) -> int:
    """Copy HF safetensors weights from ``directory`` into this stage's shard of ``model``.

    Each rank reads only the HF tensors of the units its stage holds and keeps its own
    TP slice (no collectives). A tied model with PP > 1 keeps a copy of the embedding
    as the last stage's ``output_layer.weight``; it is filled from the embedding too.
    Missing or unexpected HF tensors raise ``ConversionError``. Returns the number of
    parameters written. Callers refresh optimizer master weights afterwards.
    """
    from megatron_rl.models import ConversionError
    from megatron_rl.models.hf_io import SafetensorsReader

    reader = SafetensorsReader.open(directory)
    units = adapter.weight_units(hf_config, padded_vocab_size=padded_vocab_size)
    expected = {name for unit in units for name in unit.hf_names}
    ignorable = adapter.ignorable_hf_names(hf_config)
    unexpected = sorted(n for n in reader.entries if n not in expected and not ignorable(n))
    if unexpected:
        raise ConversionError(f"unexpected HF tensor '{unexpected[0]}' in {directory} ({len(unexpected)} in all)")
    local = global_parameters(model, adapter)
    if "output_layer.weight" in local and not any(u.mcore_name == "output_layer.weight" for u in units):
        # Tied embeddings, last stage of a pipeline: its output layer is the embedding.
        local.setdefault("embedding.word_embeddings.weight", local.pop("output_layer.weight"))
    written = 0
    for unit in units:
        param = local.pop(unit.mcore_name, None)
        if param is None:
            continue
        missing = [n for n in unit.hf_names if n not in reader.entries]
        if missing:
            raise ConversionError(f"HF tensor '{missing[0]}' is missing from {directory}")
        full = adapter.hf_to_mcore(unit, {n: reader.read(n) for n in unit.hf_names})
        # An expert's weights are split over the expert TP group, every other TP-split one over TP.
        tp_rank, tp_size = (groups.etp_rank, groups.etp_size) if unit.expert is not None else (groups.tp_rank, groups.tp_size)
        shard = take_tp_shard(unit.mcore_name, full, param, tp_rank=tp_rank, tp_size=tp_size,
                              gated_linear_unit=gated_linear_unit)  # fmt: skip
        if shard.shape != param.shape:
            raise ConversionError(f"'{unit.mcore_name}': HF gives shard {tuple(shard.shape)}, model has {tuple(param.shape)}")
        param.copy_(shard)
        written += 1
    if local:
        raise ConversionError(f"no HF weights for model parameter '{sorted(local)[0]}' ({len(local)} in all)")
    return written


class HFWeightSource:
    """The actor's weights as a weight-transfer source (``weight_sync.transports.gloo.WeightSource``):
    HF-named full tensors in ``dtype`` (the engines' dtype; cast before they leave the
    device, so a bf16 engine costs half the bytes of a float32 actor).

    ``metadata()`` comes from the adapter's weight units (names and full shapes, no
    collectives); iteration is :func:`iter_hf_weights` one unit at a time (the senders
    bucket the stream themselves; collectives: every rank iterates it in lockstep).
    ``every_rank``: every rank receives the full tensors (vLLM's CUDA IPC, where each
    GPU's actor rank hands its own copy to the engine worker on that GPU); otherwise only
    global rank 0, the sender, does (``to_first_rank``) and the others yield nothing.
    """

    def __init__(self, model: torch.nn.Module, *, dtype: torch.dtype, every_rank: bool = False, **kwargs: Any):
        self.model = model
        self.dtype = dtype
        self.every_rank = every_rank
        self.kwargs = kwargs

    def metadata(self) -> list[TensorMeta]:
        units = self.kwargs["adapter"].weight_units(
            self.kwargs["hf_config"], padded_vocab_size=self.kwargs["padded_vocab_size"]
        )  # fmt: skip
        dtype = str(self.dtype).removeprefix("torch.")
        return [TensorMeta(n, dtype, tuple(s)) for unit in units for n, s in zip(unit.hf_names, unit.hf_shapes)]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        stream = iter_hf_weights(self.model, bucket_bytes=1, to_first_rank=not self.every_rank, **self.kwargs)
        for name, tensor in stream:
            yield name, tensor if tensor.dtype == self.dtype else tensor.to(self.dtype)


def gather_adapters(
    model: torch.nn.Module, *, lora: Any, adapter: DecoderAdapter, hf_config: Mapping[str, Any],
    padded_vocab_size: int, groups: ProcessGroups, gated_linear_unit: bool = True,
) -> AdapterUpdate | None:  # fmt: skip
    """The LoRA adapters of the whole model (``lora``: ``models.lora.LoRASettings``) as PEFT
    tensors on global rank 0 (``rollout.lora_sync: adapter``); ``None`` on every other rank.

    Collectives: within DP replica 0, per adapted linear, a gather of the TP-split adapter
    matrix to TP rank 0 (B of a column-parallel linear by rows, SwiGLU fc1's ``[gate_t; up_t]``
    rows joined as W's are; A of a row-parallel one by columns), then one object gather of
    each stage's adapters over ``groups.pp`` to stage 0. Other replicas take part in nothing
    (they hold the same adapters). The fused linears become HF's projections on rank 0
    (``models.convert.lora_export.peft_tensors``: each projection A whole, its rows of B).
    """
    from megatron_rl.models.convert.lora_export import LoRAExport, adapted_units, peft_tensors
    from megatron_rl.weight_sync.adapters import AdapterUpdate

    if groups.dp_rank != 0:
        return None
    mine: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    tp = dict(tp_group=groups.tp, tp_rank=groups.tp_rank, tp_size=groups.tp_size, gated_linear_unit=gated_linear_unit)
    for name, module in global_parameters(model, adapter, merge_adapters=True).merged.items():
        # ``name`` is the adapted weight's: B of fc1 is then joined as the weight's rows are.
        a = gather_tp_shards_to_first(name, module.lora_a, **tp)
        b = gather_tp_shards_to_first(name, module.lora_b, **tp)
        if a is not None:
            mine[name] = (a.float().cpu(), b.float().cpu())
    if groups.tp_rank != 0:
        return None
    stages: list[Any] = [mine]
    if groups.pp_size > 1:
        first = groups.pp_global_ranks[0]
        stages = [None] * groups.pp_size if groups.pp_rank == 0 else None
        dist.gather_object(mine, stages, dst=first, group=groups.pp)
        if groups.pp_rank != 0:
            return None
    gathered = {name: pair for stage in stages for name, pair in stage.items()}
    export = LoRAExport(rank=lora.rank, alpha=lora.alpha, target_modules=tuple(lora.target_modules))
    tensors: dict[str, torch.Tensor] = {}
    for unit in adapted_units(adapter.weight_units(hf_config, padded_vocab_size=padded_vocab_size), export):
        if unit.mcore_name not in gathered:
            raise KeyError(f"no pipeline stage holds the adapter of '{unit.mcore_name}'")
        tensors.update(peft_tensors(unit, *gathered.pop(unit.mcore_name), export))
    if gathered:
        raise KeyError(f"adapters of no HF projection: {sorted(gathered)[:3]} ({len(gathered)} in all)")
    return AdapterUpdate(rank=lora.rank, alpha=lora.alpha, tensors=tensors)
