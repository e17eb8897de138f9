"""The HF <-> Megatron weight layout of the Llama-family decoders: which HF tensors make
each Megatron parameter (:class:`WeightUnit`) and the transforms between them.

Layout contract. A *full* Megatron tensor is what the tensor-parallel shards of one
parameter concatenate to (along dim 0 for column-parallel, dim 1 for row-parallel).
megatron-core's dist-checkpoint stores exactly these full tensors, with the per-layer
tensors of the decoder stacked on a new leading layer dimension; so a converted
checkpoint is independent of TP/PP except for the vocabulary padding.

====================================  ==========================================  =====================
Megatron (canonical name, layer i)    HF (Llama-family names)                      transform
====================================  ==========================================  =====================
embedding.word_embeddings.weight      model.embed_tokens.weight                    pad rows to Vp
...linear_qkv.layer_norm_weight       model.layers.i.input_layernorm.weight        copy
...linear_qkv.weight [(nh+2ng)d, H]   self_attn.{q,k,v}_proj.weight                per group [q.., k, v]
...linear_qkv.bias   [(nh+2ng)d]      self_attn.{q,k,v}_proj.bias (Qwen2)          per group [q.., k, v]
...q_layernorm.weight / k_layernorm   self_attn.q_norm / k_norm (Qwen3)            copy
...linear_proj.weight [H, nh*d]       self_attn.o_proj.weight                      copy
...mlp.linear_fc1.layer_norm_weight   post_attention_layernorm.weight              copy
...mlp.linear_fc1.weight [2F, H]      mlp.gate_proj.weight, mlp.up_proj.weight     [gate; up]
...mlp.linear_fc2.weight [H, F]       mlp.down_proj.weight                         copy
decoder.final_layernorm.weight        model.norm.weight                            copy
output_layer.weight (untied only)     lm_head.weight                               pad rows to Vp
====================================  ==========================================  =====================

``...`` is ``decoder.layers.i.self_attention`` for attention rows and
``decoder.layers.i`` for MLP rows. The layer-norm names are the ones megatron-core
itself uses in checkpoints for both the local and the Transformer-Engine spec (the
local spec maps ``input_layernorm.`` and ``pre_mlp_layernorm.`` onto them through its
``sharded_state_dict_keys_map``); :func:`canonical_mcore_name` applies the same map to
parameter names of a local-spec model.

QKV interleaving: megatron's ``SelfAttention`` views the fused projection output as
``[ng, (nh/ng + 2) * d]`` and splits each group into ``nh/ng`` query heads, one key
head and one value head, so the fused weight is, per query group ``g``,
``[q heads g*nh/ng .. (g+1)*nh/ng-1; k head g; v head g]``. Tensor parallelism gives
each rank ``ng/TP`` whole groups, so the full tensor above is TP-independent.

Mixture-of-experts layers (:mod:`megatron_rl.models.moe`; ``E`` experts of width ``F_e``,
``j`` the global expert index) replace the three MLP rows:

====================================  ==========================================  =====================
...pre_mlp_layernorm.weight [H]       post_attention_layernorm.weight              copy
...mlp.router.weight [E, H]           mlp.gate.weight                              copy
...local_experts.j.linear_fc1.weight  mlp.experts.j.gate_proj.weight, up_proj      [gate; up]
...local_experts.j.linear_fc2.weight  mlp.experts.j.down_proj.weight               copy
====================================  ==========================================  =====================

``...`` is ``decoder.layers.i`` and ``...local_experts`` is
``decoder.layers.i.mlp.experts.local_experts`` (fc1 ``[2 F_e, H]``, fc2 ``[H, F_e]``).
The pre-MLP norm of a MoE layer keeps its own name: there is no ``linear_fc1`` to fuse
it into, and megatron-core's Transformer-Engine spec checkpoints it under that name.

In the dist-checkpoint (:func:`checkpoint_region`) the experts of every layer share one key
per projection, ``decoder.layers.mlp.experts.experts.linear_fc1.weight`` (and ``linear_fc2``),
of global shape ``(num_layers, E, *mcore_shape)``: megatron-core's ``SequentialMLP`` and
``TEGroupedMLP`` both put local expert ``l`` of expert-parallel rank ``r`` at global index
``j = r * E / EP + l`` on an expert axis after the layer axis, so the checkpoint does not
depend on EP (nor, as above, on TP).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

import torch

__all__ = [
    "LAYER_PREFIX",
    "ConversionError",
    "WeightUnit",
    "canonical_mcore_name",
    "checkpoint_region",
    "fuse_qkv",
    "hf_to_mcore",
    "index_by_mcore_name",
    "mcore_to_hf",
    "split_qkv",
]


class ConversionError(Exception):
    """A checkpoint or config that cannot be converted; the message names the file/tensor."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class WeightUnit:
    """One Megatron parameter and the HF tensors it is made of.

    ``mcore_shape`` is the full (TP-gathered) shape of one layer's tensor; in the
    dist-checkpoint a decoder-layer unit is row ``layer`` of a tensor of global shape
    ``(num_layers, *mcore_shape)`` stored under ``sharded_key``.
    """

    kind: Literal["copy", "qkv", "gate_up", "vocab"]
    mcore_name: str
    """Canonical GPTModel parameter name with the *global* layer index."""
    sharded_key: str
    """dist-checkpoint key (``decoder.layers.<suffix>`` for layer units)."""
    layer: int | None
    """Global layer index; None for embedding, final norm and output layer."""
    hf_names: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    mcore_shape: tuple[int, ...]
    num_query_groups: int = 1
    """ng, used by ``qkv`` units only."""
    expert: int | None = None
    """Global expert index j of a mixture-of-experts expert unit (HF ``mlp.experts.<j>.``);
    None otherwise. megatron-core's dist-checkpoint stores expert j of layer i as element
    ``[i, j]`` of a tensor of global shape ``(num_layers, num_experts, *mcore_shape)`` under
    ``sharded_key``, whatever the expert parallelism. ``mcore_name`` names it by its index
    among the local experts of its rank, which is j at expert parallelism 1."""
    num_experts: int = 0
    """E, the length of the expert axis of ``sharded_key`` (expert units only)."""


LAYER_PREFIX = "decoder.layers."

# Local-spec parameter names -> the names megatron-core checkpoints use (and TE uses).
_LOCAL_SPEC_ALIASES = {
    "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
}


def canonical_mcore_name(name: str) -> str:
    """Map a local-spec GPTModel parameter name to the canonical (TE/checkpoint) name.

    ``decoder.layers.3.input_layernorm.weight`` ->
    ``decoder.layers.3.self_attention.linear_qkv.layer_norm_weight``; other names are
    returned unchanged. Layer indices are not touched: a pipeline stage must add its
    first global layer index to its local indices first.
    """
    if not name.startswith(LAYER_PREFIX):
        return name
    index, _, rest = name[len(LAYER_PREFIX) :].partition(".")
    for old, new in _LOCAL_SPEC_ALIASES.items():
        if rest.startswith(old):
            return f"{LAYER_PREFIX}{index}.{new}{rest[len(old) :]}"
    return name


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, num_query_groups: int) -> torch.Tensor:
    """HF q ``[nh*d, ...]``, k/v ``[ng*d, ...]`` -> Megatron fused ``[(nh+2ng)*d, ...]``.

    Works for weights (``...`` = H) and biases (no trailing dims). Each query group
    contributes its ``nh/ng`` query heads, then its key head, then its value head.
    """
    ng = num_query_groups
    rest = q.shape[1:]
    fused = torch.cat([q.reshape(ng, -1, *rest), k.reshape(ng, -1, *rest), v.reshape(ng, -1, *rest)], dim=1)
    return fused.reshape(-1, *rest)


def split_qkv(
    qkv: torch.Tensor, *, num_query_groups: int, q_rows: int, kv_rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv`: fused ``[(nh+2ng)*d, ...]`` -> (q, k, v), contiguous."""
    ng = num_query_groups
    rest = qkv.shape[1:]
    grouped = qkv.reshape(ng, -1, *rest)
    q, k, v = torch.split(grouped, [q_rows // ng, kv_rows // ng, kv_rows // ng], dim=1)
    return (
        q.reshape(q_rows, *rest).contiguous(),
        k.reshape(kv_rows, *rest).contiguous(),
        v.reshape(kv_rows, *rest).contiguous(),
    )


def _check_shape(name: str, tensor: torch.Tensor, expected: Sequence[int], what: str = "tensor") -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise ConversionError(f"{what} '{name}' has shape {tuple(tensor.shape)}, expected {tuple(expected)}")


def hf_to_mcore(unit: WeightUnit, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Build the full Megatron tensor of ``unit`` (shape ``unit.mcore_shape``) from HF tensors.

    ``tensors`` maps each of ``unit.hf_names`` to its HF tensor; shapes are checked
    (a mismatch raises :class:`ConversionError` naming the tensor). Vocabulary padding
    rows are zeros.
    """
    for name, shape in zip(unit.hf_names, unit.hf_shapes):
        if name not in tensors:
            raise ConversionError(f"HF tensor '{name}' is missing")
        _check_shape(name, tensors[name], shape, "HF tensor")
    parts = [tensors[name] for name in unit.hf_names]
    if unit.kind == "copy":
        return parts[0]
    if unit.kind == "qkv":
        return fuse_qkv(*parts, num_query_groups=unit.num_query_groups)
    if unit.kind == "gate_up":
        return torch.cat(parts, dim=0)
    if unit.kind == "vocab":
        (table,) = parts
        if tuple(table.shape) == tuple(unit.mcore_shape):
            return table  # nothing to pad: avoid a copy of the largest tensor
        padded = table.new_zeros(unit.mcore_shape)
        padded[: table.shape[0]].copy_(table)
        return padded
    raise AssertionError(f"unknown unit kind {unit.kind}")


def mcore_to_hf(unit: WeightUnit, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Split the full Megatron tensor of ``unit`` into ``(hf_name, tensor)`` pairs.

    For ``vocab`` units any number of padding rows ``>= V`` is accepted (the padding
    depends on the TP size the checkpoint was written at) and stripped.
    """
    if unit.kind == "vocab":
        rows = unit.hf_shapes[0][0]
        if tensor.dim() != 2 or tensor.shape[0] < rows or tensor.shape[1] != unit.mcore_shape[1]:
            raise ConversionError(
                f"Megatron tensor '{unit.mcore_name}' has shape {tuple(tensor.shape)}; expected "
                f"[>= {rows}, {unit.mcore_shape[1]}] for vocab_size={rows} (wrong vocab size?)"
            )
        return [(unit.hf_names[0], tensor[:rows])]
    _check_shape(unit.mcore_name, tensor, unit.mcore_shape, "Megatron tensor")
    if unit.kind == "copy":
        return [(unit.hf_names[0], tensor)]
    if unit.kind == "qkv":
        q, k, v = split_qkv(
            tensor, num_query_groups=unit.num_query_groups, q_rows=unit.hf_shapes[0][0], kv_rows=unit.hf_shapes[1][0]
        )
        return list(zip(unit.hf_names, (q, k, v)))
    if unit.kind == "gate_up":
        gate, up = torch.chunk(tensor, 2, dim=0)
        return [(unit.hf_names[0], gate.contiguous()), (unit.hf_names[1], up.contiguous())]
    raise AssertionError(f"unknown unit kind {unit.kind}")


def index_by_mcore_name(units: Iterable[WeightUnit]) -> dict[str, WeightUnit]:
    """``{unit.mcore_name: unit}``; look names up through :func:`canonical_mcore_name`."""
    return {u.mcore_name: u for u in units}


def checkpoint_region(unit: WeightUnit, num_layers: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """``(global shape, offsets, sizes)`` of ``unit``'s tensor under ``unit.sharded_key`` in
    megatron-core's dist-checkpoint of a ``num_layers``-layer GPTModel.

    Embedding, final norm and output layer: the whole tensor. A decoder-layer unit: row
    ``layer`` of ``(num_layers, *mcore_shape)``. An expert unit: element ``[layer, expert]``
    of ``(num_layers, num_experts, *mcore_shape)``. The region's sizes are 1 on the
    leading (layer, expert) axes and ``mcore_shape`` after them.
    """
    shape = tuple(unit.mcore_shape)
    if unit.layer is None:
        return shape, (0,) * len(shape), shape
    if not 0 <= unit.layer < num_layers:
        raise ConversionError(f"'{unit.mcore_name}': layer {unit.layer} is outside [0, {num_layers})")
    leading, index = (num_layers,), (unit.layer,)
    if unit.expert is not None:
        if not 0 <= unit.expert < unit.num_experts:
            raise ConversionError(f"'{unit.mcore_name}': expert {unit.expert} is outside [0, {unit.num_experts})")
        leading, index = (num_layers, unit.num_experts), (unit.layer, unit.expert)
    ones = (1,) * len(leading)
    return (*leading, *shape), (*index, *(0,) * len(shape)), (*ones, *shape)
