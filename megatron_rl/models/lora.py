"""LoRA adapters on megatron-core's tensor-parallel linear layers, built into the layer spec.

``y = W x + (alpha / rank) * B A dropout(x)``, W frozen, A ``[rank, in]`` and B
``[out, rank]`` trained, B zero at the start (so the model starts as the base model).
:class:`LoRAColumnParallelLinear` and :class:`LoRARowParallelLinear` subclass megatron's
``ColumnParallelLinear`` and ``RowParallelLinear``: the base forward runs unchanged and the
adapter's product is added to its output; :func:`with_lora` swaps them into a layer spec's
``linear_qkv`` / ``linear_proj`` / ``linear_fc1`` / ``linear_fc2`` (composition through
``ModuleSpec``: megatron's model code is not touched). The parameter names stay megatron's
(``...linear_qkv.weight``) plus ``lora_a`` / ``lora_b`` beside them.

Tensor parallelism, with TP ranks t = 1..T (the reductions megatron's layers do):

* column-parallel (W sharded by output rows): A is replicated (the layer's input is), B is
  sharded by rows like W. ``u = A x`` is the same on every rank; it enters the sharded
  part through ``copy_to_tensor_model_parallel_region`` (identity forward, all-reduce of
  ``du`` backward, so A's gradient sums every shard's share and is the same on every rank).
  With sequence parallelism x is this rank's slice of the sequence: ``u`` is gathered along
  the sequence instead (all-gather forward, reduce-scatter backward), and A's gradient,
  different on each rank, is summed over the TP group by megatron's finalize step, which
  sums every parameter marked ``sequence_parallel`` (the norms' way).
* row-parallel (W sharded by input columns): A is sharded by columns like W, B is
  replicated. ``A_t x_t`` is a partial sum: all-reduced (or reduce-scattered along the
  sequence with sequence parallelism, as the base output is) before B, so B sees the full
  ``u``. B's gradient is then the same on every rank, or, with sequence parallelism, a
  per-slice share marked ``sequence_parallel``.

Initialisation (:func:`init_lora`, after the model is built, when the global layer numbers
are known): A is drawn whole (Kaiming-uniform, as PEFT's) from a generator seeded by the
seed, the layer's global number and the linear's name, and each rank keeps its shard, so
every TP/PP layout holds the same A; B is zero. Sharded adapter parameters carry megatron's
tensor-parallel attributes (the gradient norm counts each shard once).
Dropout masks: the default torch generator where x is the same on every TP rank (the
actor seeds it alike across TP ranks), megatron's model-parallel RNG tracker where each rank
holds different data (a sequence slice, an input shard).
"""

from __future__ import annotations

import contextlib
import functools
import math
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel import mappings
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_rl.models.convert.lora_export import ADAPTER_SUFFIXES

__all__ = [
    "TARGET_MODULES",
    "LoRAColumnParallelLinear",
    "LoRARowParallelLinear",
    "LoRASettings",
    "adapters_off",
    "init_lora",
    "ADAPTER_SUFFIXES",
    "lora_modules",
    "with_lora",
]

TARGET_MODULES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""The dense layer's linear layers an adapter can sit on (megatron's names): attention's
fused QKV and output projections, the MLP's fused gate/up and down projections."""


@dataclass(frozen=True, kw_only=True)
class LoRASettings:
    """What each adapted layer needs (from ``actor.lora`` and the run's seed)."""

    rank: int
    """r: the adapter's inner width."""
    alpha: float
    """The update is scaled by ``alpha / rank``."""
    dropout: float = 0.0
    """Dropout on the adapter's input (training forwards only)."""
    seed: int = 0
    """Seeds A's initialisation (with the global layer number and the linear's name)."""
    target_modules: tuple[str, ...] = TARGET_MODULES
    """Which of :data:`TARGET_MODULES` carry an adapter."""

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class _LoRAMixin:
    """Adapter parameters and their product; the subclasses place the TP reductions."""

    lora: LoRASettings
    lora_name: str
    _a_shape: tuple[int, int]
    _a_slice: tuple[slice, slice]

    def _init_adapter(self, lora: LoRASettings, name: str, a_shape, a_slice, b_shape, sharded: str) -> None:
        """Adapter parameters (A from the default generator until :meth:`reset_adapter`, B
        zero); ``sharded``: which of them is split over the TP group, ``"a"`` or ``"b"``."""
        self.lora, self.lora_name, self._a_shape, self._a_slice = lora, name, a_shape, a_slice
        self.adapter_on = True
        """False: the layer computes its base ``W x`` alone (:func:`adapters_off`)."""
        self._tp_axes = {"weight": 0, "bias": 0, "lora_b": 0} if sharded == "b" else {"weight": 1, "lora_a": 1}
        for p in self.parameters(recurse=False):  # the base layer's weight and bias: frozen
            p.requires_grad_(False)
        dtype, device = self.weight.dtype, self.weight.device
        self.lora_a = torch.nn.Parameter(torch.empty(a_shape, dtype=dtype)[a_slice].contiguous().to(device))
        self.lora_b = torch.nn.Parameter(torch.zeros(b_shape, dtype=dtype, device=device))
        dim = 0 if sharded == "b" else 1  # B by rows (column-parallel), A by columns (row-parallel)
        tensor_parallel.set_tensor_model_parallel_attributes(getattr(self, f"lora_{sharded}"), True, dim, 1)
        self.reset_adapter(layer_number=0)

    @torch.no_grad()
    def reset_adapter(self, *, layer_number: int) -> None:
        """A drawn whole from (seed, global layer number, name), this rank's shard kept; B zero."""
        key = zlib.crc32(f"{self.lora.seed}/{layer_number}/{self.lora_name}".encode())
        full_a = torch.empty(self._a_shape)
        bound = 1.0 / math.sqrt(self._a_shape[1])  # kaiming_uniform_(a=sqrt(5)), as nn.Linear and PEFT
        full_a.uniform_(-bound, bound, generator=torch.Generator().manual_seed(key))
        self.lora_a.copy_(full_a[self._a_slice])
        self.lora_b.zero_()

    def merged_weight(self) -> torch.Tensor:
        """This rank's shard of ``W + (alpha / rank) B A`` (W's shape, dtype and TP attributes;
        summed in float32). The TP shards need no communication: a column-parallel layer's rows of W
        take ``B_t A`` (its rows of B), a row-parallel layer's columns take ``B A_t``."""
        delta = self.lora_b.detach().float() @ self.lora_a.detach().float()
        merged = (self.weight.detach().float() + self.lora.scale * delta).to(self.weight.dtype)
        for attr in ("tensor_model_parallel", "partition_dim", "partition_stride"):  # how W is split over TP
            if hasattr(self.weight, attr):
                setattr(merged, attr, getattr(self.weight, attr))
        return merged

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """megatron's, with the sharded adapter parameter split along its TP axis (the
        replicated one is saved once, as the layer's bias of a row-parallel linear is)."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state_dict = self.state_dict(prefix="", keep_vars=True)
        sharded = make_sharded_tensors_for_checkpoint(
            state_dict, prefix, self._tp_axes, sharded_offsets,
            tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"],
        )  # fmt: skip
        if self.lora_name == "linear_fc1" and self.config.gated_linear_unit:
            # B's rows follow W's: [gate_t; up_t] on TP rank t. megatron's MLP saves W (and its
            # bias) through its SwiGLU factory so that any TP reads [gate; up]; B the same.
            key = f"{prefix}lora_b"
            sharded[key] = _swiglu_sharded(sharded[key], sharded_offsets, metadata, self.tp_group)
        return sharded

    def _dropout(self, x: torch.Tensor, *, same_on_every_tp_rank: bool) -> torch.Tensor:
        p = self.lora.dropout
        if p == 0.0 or not self.training:
            return x
        if same_on_every_tp_rank:
            return torch.nn.functional.dropout(x, p)
        with tensor_parallel.get_cuda_rng_tracker().fork():
            return torch.nn.functional.dropout(x, p)


def _swiglu_sharded(tensor, sharded_offsets, metadata, tp_group):
    """megatron's ``apply_swiglu_sharded_factory`` (its arguments grew after megatron-core 0.16)."""
    import inspect

    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    singleton = (metadata or {}).get("singleton_local_shards", False)
    if "tp_group" in inspect.signature(apply_swiglu_sharded_factory).parameters:
        return apply_swiglu_sharded_factory(tensor, sharded_offsets, singleton, tp_group=tp_group,
                                            dp_group=metadata["dp_cp_group"])  # fmt: skip
    return apply_swiglu_sharded_factory(tensor, sharded_offsets, singleton)


class LoRAColumnParallelLinear(_LoRAMixin, ColumnParallelLinear):
    """``ColumnParallelLinear`` plus a LoRA adapter (module doc: A replicated, B by rows).

    Input ``[s, b, in]`` (``[s/T, b, in]`` with sequence parallelism), output
    ``[s, b, out/T]``, as the base layer's (``gather_output`` is not supported)."""

    def __init__(self, input_size: int, output_size: int, *, lora: LoRASettings, lora_name: str = "", **kwargs):
        super().__init__(input_size, output_size, **kwargs)
        if self.gather_output or self.is_expert:
            raise ValueError("LoRA adapters sit on a dense layer's non-gathered column-parallel linears only")
        everything = (slice(None), slice(None))
        self._init_adapter(lora, lora_name, (lora.rank, input_size), everything,
                           (self.output_size_per_partition, lora.rank), sharded="b")  # fmt: skip
        if self.sequence_parallel:
            self.lora_a.sequence_parallel = True  # megatron sums its gradient over the TP group

    def forward(
        self, input_: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output: bool | None = None
    ):
        if runtime_gather_output:
            raise ValueError("LoRA adapters do not support gather_output")
        output, bias = super().forward(input_, weight, runtime_gather_output)
        if not self.adapter_on:
            return output, bias
        x = self._dropout(input_, same_on_every_tp_rank=not self.sequence_parallel)
        u = torch.matmul(x, self.lora_a.t())  # [s(/T), b, r]
        if self.sequence_parallel:
            u = mappings.gather_from_sequence_parallel_region(u, group=self.tp_group)
        else:
            u = mappings.copy_to_tensor_model_parallel_region(u, group=self.tp_group)
        return output + self.lora.scale * torch.matmul(u, self.lora_b.t()), bias


class LoRARowParallelLinear(_LoRAMixin, RowParallelLinear):
    """``RowParallelLinear`` plus a LoRA adapter (module doc: A by columns, B replicated).

    Input ``[s, b, in/T]`` (``input_is_parallel``), output ``[s, b, out]`` (``[s/T, b, out]``
    with sequence parallelism), as the base layer's."""

    def __init__(self, input_size: int, output_size: int, *, lora: LoRASettings, lora_name: str = "", **kwargs):
        super().__init__(input_size, output_size, **kwargs)
        if not self.input_is_parallel or self.is_expert:
            raise ValueError("LoRA adapters sit on a dense layer's input-parallel row-parallel linears only")
        cols, rank = self.input_size_per_partition, self.tp_group.rank()
        a_slice = (slice(None), slice(rank * cols, (rank + 1) * cols))
        self._init_adapter(lora, lora_name, (lora.rank, input_size), a_slice, (output_size, lora.rank), sharded="a")
        if self.sequence_parallel:
            self.lora_b.sequence_parallel = True

    def forward(self, input_: torch.Tensor):
        output, bias = super().forward(input_)
        if not self.adapter_on:
            return output, bias
        x = self._dropout(input_, same_on_every_tp_rank=False)  # each rank holds other columns
        u = torch.matmul(x, self.lora_a.t())  # a partial sum over this rank's columns
        if self.sequence_parallel:
            u = mappings.reduce_scatter_to_sequence_parallel_region(u, group=self.tp_group)
        else:
            u = mappings.reduce_from_tensor_model_parallel_region(u, group=self.tp_group)
        return output + self.lora.scale * torch.matmul(u, self.lora_b.t()), bias


_LORA_CLASS = {ColumnParallelLinear: LoRAColumnParallelLinear, RowParallelLinear: LoRARowParallelLinear}


def with_lora(layer_spec: ModuleSpec, lora: LoRASettings) -> ModuleSpec:
    """A copy of a local-spec decoder-layer spec whose ``lora.target_modules`` carry adapters.

    Raises ``ValueError`` naming a target whose module is not a plain megatron
    column/row-parallel linear (the Transformer-Engine spec's fused norm + linear layers)."""
    import copy

    target_modules = lora.target_modules
    unknown = sorted(set(target_modules) - set(TARGET_MODULES))
    if unknown:
        raise ValueError(f"unknown LoRA target modules {unknown}; choose from {list(TARGET_MODULES)}")
    spec = copy.deepcopy(layer_spec)
    found = set()
    for block in (spec.submodules.self_attention, spec.submodules.mlp):
        sub = _submodules(block)
        for name in TARGET_MODULES:
            if name not in target_modules or not hasattr(sub, name):
                continue
            module = getattr(sub, name)
            cls = module.module if isinstance(module, ModuleSpec) else module
            if cls not in _LORA_CLASS:
                raise ValueError(f"LoRA on {name} needs megatron's local linear layers, not {cls.__name__}")
            params = dict(module.params) if isinstance(module, ModuleSpec) else {}
            setattr(sub, name, ModuleSpec(module=_LORA_CLASS[cls], params={**params, "lora": lora, "lora_name": name}))
            found.add(name)
    missing = sorted(set(target_modules) - found)
    if missing:
        raise ValueError(f"the layer spec has no {missing}")
    return spec


def _submodules(block):
    """A block spec's submodules: a ``ModuleSpec``'s, or (megatron-core 0.19's MLP) those a
    ``functools.partial`` of the block's builder is given."""
    if isinstance(block, ModuleSpec):
        return block.submodules
    if isinstance(block, functools.partial) and "submodules" in block.keywords:
        return block.keywords["submodules"]
    raise ValueError(f"cannot find the linear layers of the layer spec's {block!r}")


def init_lora(model_chunks: Iterable[torch.nn.Module]) -> int:
    """Make the built model a LoRA model: initialise every adapter (module doc: A from the
    seed, the global layer number, megatron's ``TransformerLayer.layer_number`` with the PP
    offset, and the linear's name; B zero) and freeze every other parameter (embedding,
    norms, output layer, the adapted layers' own weights). Returns the number of adapted
    linears on this rank."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    count = 0
    for chunk in model_chunks:
        adapters = set()
        for layer in chunk.modules():
            if isinstance(layer, TransformerLayer):
                for module in layer.modules():
                    if isinstance(module, _LoRAMixin):
                        module.reset_adapter(layer_number=layer.layer_number)
                        adapters |= {id(module.lora_a), id(module.lora_b)}
                        count += 1
        for param in chunk.parameters():
            param.requires_grad_(id(param) in adapters)
    return count


def lora_modules(model_chunks: Iterable[torch.nn.Module]) -> list[torch.nn.Module]:
    """Every adapted linear below ``model_chunks``."""
    return [m for chunk in model_chunks for m in chunk.modules() if isinstance(m, _LoRAMixin)]


@contextlib.contextmanager
def adapters_off(model_chunks: Iterable[torch.nn.Module]) -> Iterator[None]:
    """Run ``model_chunks`` as the base model: every adapted linear computes ``W x`` alone
    (the reference policy of a LoRA run; its weights are the frozen base)."""
    modules = lora_modules(model_chunks)
    for m in modules:
        m.adapter_on = False
    try:
        yield
    finally:
        for m in modules:
            m.adapter_on = True
