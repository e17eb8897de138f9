"""HF <-> Megatron mapping of mixture-of-experts decoders (the Qwen3-MoE layout).

A MoE decoder is a Llama-family decoder whose MLP is a routed mixture of SwiGLU experts:
attention, norms, embedding and output layer map as in :mod:`megatron_rl.models.common`;
:class:`MoEDecoderAdapter` adds the MoE fields of megatron-core's ``TransformerConfig``,
the MoE layer spec, and the router and per-expert weight units.

Routing (HF ``Qwen3MoeTopKRouter`` in transformers 5.19; megatron-core 0.16.1
``TopKRouter`` with ``topk_routing_with_score_function``). Both compute router logits
``l = x W^T`` (``W`` ``[E, H]``, no bias) and take the top-k experts; they differ only in
where the softmax is taken, and the two orders give the same weights:

* HF: ``p = softmax(l)`` over all E experts, ``top-k(p)``; with ``norm_topk_prob`` the k
  weights are divided by their sum.
* megatron ``moe_router_pre_softmax=True``: ``softmax(l)`` then ``top-k``, no renormalisation
  -- HF with ``norm_topk_prob=false``.
* megatron ``moe_router_pre_softmax=False`` (its default): ``top-k(l)`` then a softmax over
  those k logits. Softmax is monotonic, so the top-k of ``l`` and of ``p`` are the same
  experts, and ``p_i / sum_topk p_j = exp(l_i) / sum_topk exp(l_j)``: HF with
  ``norm_topk_prob=true``.

Each selected expert's output is scaled by its weight and the k outputs are summed (HF
scales after ``down_proj``, megatron's ``SequentialMLP`` before ``linear_fc2``; both
projections are bias-free, so the results agree to rounding).

Layer layout: HF makes layer i sparse when ``i not in mlp_only_layers`` and
``(i + 1) % decoder_sparse_step == 0``; every released Qwen3-MoE model has every layer
sparse (``decoder_sparse_step=1``, ``mlp_only_layers=[]``), the only layout supported here.
Others raise :class:`ConversionError` naming the field: they need a per-layer block spec
(megatron's ``moe_layer_freq`` list and dense layers of ``intermediate_size``) that the
one-layer-spec adapter interface cannot express yet.

Nothing here imports megatron-core at module level.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Mapping
from typing import Any

import torch

from megatron_rl.models.common import (
    DecoderAdapter,
    ModelDims,
    _local_spec,
    _te_available,
    config_dict,
    layer_unit,
)
from megatron_rl.models.weight_units import LAYER_PREFIX, ConversionError, WeightUnit, canonical_mcore_name

__all__ = ["MoEDims", "MoEDecoderAdapter", "megatron_routers", "sparse_layers", "torch_gating_router"]

# HF Qwen3MoeConfig defaults (transformers 5.19), for config.json files that omit a field.
_DEFAULT_NORM_TOPK_PROB = False
_DEFAULT_ROUTER_AUX_LOSS_COEF = 0.001

# Transformer-Engine grouped-GEMM expert parameters (TEGroupedMLP -> TE GroupedLinear keeps
# local expert j's weight as ``weight<j>``), relative to ``decoder.layers.<i>.``.
_TE_GROUPED_EXPERT = re.compile(r"mlp\.experts\.(linear_fc[12])\.weight(\d+)")

# TransformerConfig.moe_router_dtype -> the dtype of the router logits (None: the input's).
_ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


def megatron_routers(chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The megatron-core ``TopKRouter`` modules of ``chunks``, in module order (one per MoE
    layer of this rank's pipeline stage)."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, TopKRouter)]


@functools.cache
def torch_gating_router() -> type:
    """megatron-core's ``TopKRouter`` with its gating GEMM (router logits ``x W^T``) done by
    torch: the local spec's router.

    megatron-core 0.16.1 computes the logits in ``RouterGatingLinearFunction``, which
    tests ``te_general_gemm is not None`` first; without Transformer Engine that name is
    never bound (the import that binds it fails and nothing sets it to None; fixed in
    0.19), so every router forward raises ``NameError``. This subclass computes the same
    product, in the same dtype (``moe_router_dtype``, else the input's), with
    ``F.linear``; routing, load-balancing losses and everything else stay megatron's.
    Built on first use, so that importing this module does not import megatron-core.
    """
    import torch.nn.functional as F
    from megatron.core.transformer.moe.router import TopKRouter

    class TorchGatingTopKRouter(TopKRouter):
        """``TopKRouter`` whose gating GEMM runs in torch (see :func:`torch_gating_router`)."""

        def gating(self, input: torch.Tensor) -> torch.Tensor:
            """Router logits ``[..., E]`` of ``input`` ``[..., H]``."""
            dtype = _ROUTER_DTYPES.get(self.config.moe_router_dtype, input.dtype)
            bias = None if self.bias is None else self.bias.to(dtype)
            return F.linear(input.to(dtype), self.weight.to(dtype), bias)

    return TorchGatingTopKRouter


@functools.cache
def _host_splits_dispatcher() -> type:
    """megatron-core's all-to-all token dispatcher handing the all-to-all its split sizes as
    host (NumPy) arrays (see :meth:`MoEDecoderAdapter.finish_model`). Built on first use."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    class HostSplitsAlltoAllTokenDispatcher(MoEAlltoAllTokenDispatcher):
        """``MoEAlltoAllTokenDispatcher`` whose split sizes become host arrays after megatron's own host copy."""

        def _maybe_dtoh_and_synchronize(self, point: str, tokens_per_expert: torch.Tensor | None = None):
            tokens_per_expert = super()._maybe_dtoh_and_synchronize(point, tokens_per_expert)
            if point == self.cuda_dtoh_point:
                for name in ("input_splits", "output_splits", "output_splits_tp"):
                    value = getattr(self, name, None)
                    if torch.is_tensor(value) and not value.is_cuda:
                        setattr(self, name, value.numpy())  # as megatron's host copy makes them
            return tokens_per_expert

    return HostSplitsAlltoAllTokenDispatcher


def _with_router(mlp: Any, router: type) -> Any:
    """The MoE layer builder ``mlp`` of a layer spec with its router replaced: a
    ``ModuleSpec`` (megatron-core 0.16) or a ``functools.partial`` of ``MoELayer`` (0.19)."""
    if isinstance(mlp, functools.partial):
        submodules = dataclasses.replace(mlp.keywords["submodules"], router=router)
        return functools.partial(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": submodules})
    return dataclasses.replace(mlp, submodules=dataclasses.replace(mlp.submodules, router=router))


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEDims:
    """Mixture-of-experts numbers read from an HF config (names follow megatron-core)."""

    num_moe_experts: int
    """E, routed experts per layer (HF ``num_experts``; transformers 5 writes ``num_local_experts``)."""
    moe_router_topk: int
    """k, experts per token (HF ``num_experts_per_tok``)."""
    moe_ffn_hidden_size: int
    """F_e, the width of one expert's gate/up (HF ``moe_intermediate_size``)."""
    norm_topk_prob: bool
    """Whether the k routing weights are renormalised to sum to 1 (see the module doc)."""
    router_aux_loss_coef: float
    """HF's load-balancing loss coefficient (see :meth:`MoEDecoderAdapter.transformer_config_kwargs`)."""


def sparse_layers(cfg: Mapping[str, Any], num_layers: int) -> list[int]:
    """HF's sparse-layer pattern as megatron's ``moe_layer_freq`` list (1: MoE, 0: dense).

    HF: layer i is sparse iff ``i not in mlp_only_layers`` and ``(i + 1) %
    decoder_sparse_step == 0`` (megatron's integer ``moe_layer_freq=N`` instead makes
    layers ``0, N, 2N, ...`` sparse, so only the list form expresses HF's pattern).
    """
    step = cfg.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise ConversionError(f"HF config: decoder_sparse_step={step!r} must be a positive integer")
    dense = cfg.get("mlp_only_layers") or []
    if not isinstance(dense, (list, tuple)):
        raise ConversionError(f"HF config: mlp_only_layers={dense!r} must be a list of layer indices")
    return [0 if (i in dense or (i + 1) % step) else 1 for i in range(num_layers)]


def _num_experts(cfg: Mapping[str, Any]) -> int:
    # Hub config.json files say num_experts; transformers 5 maps that attribute onto
    # num_local_experts and writes only the latter.
    values = {key: cfg[key] for key in ("num_experts", "num_local_experts") if cfg.get(key) is not None}
    if not values:
        raise ConversionError("HF config: required field 'num_experts' (or 'num_local_experts') is missing")
    if len(set(values.values())) > 1:
        raise ConversionError(f"HF config: num_experts={values['num_experts']} and "
                              f"num_local_experts={values['num_local_experts']} disagree")  # fmt: skip
    (value,) = set(values.values())
    key = next(iter(values))
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConversionError(f"HF config: {key}={value!r} is not supported (a MoE model needs at least one expert; "
                              "num_experts=0 is a dense model)")  # fmt: skip
    return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEDecoderAdapter(DecoderAdapter):
    """HF <-> Megatron adapter for a decoder whose every MLP is a routed mixture of SwiGLU
    experts without shared experts (Qwen3-MoE).

    Use it like :class:`DecoderAdapter`; differences:

    * ``transformer_config_kwargs`` adds the MoE fields (router, expert width, dispatcher);
    * ``layer_spec`` is megatron's MoE layer: experts as a ``SequentialMLP`` of local
      ``ColumnParallelLinear``/``RowParallelLinear`` on the local spec, Transformer-Engine
      grouped GEMM (``TEGroupedMLP``) on the TE spec;
    * the weight units of each layer's MLP are the pre-MLP norm, the router
      ``[E, H]`` and, per expert j, fc1 ``[2 F_e, H]`` and fc2 ``[H, F_e]``
      (``WeightUnit.expert`` = j).
    """

    # -- config --------------------------------------------------------------

    def moe_dims(self, hf_config: Any) -> MoEDims:
        """Validate the config (:meth:`dims` included) and read the MoE numbers."""
        cfg = config_dict(hf_config)
        d = self.dims(cfg)
        pattern = sparse_layers(cfg, d.num_layers)
        if not all(pattern):
            field = "mlp_only_layers" if cfg.get("mlp_only_layers") else "decoder_sparse_step"
            raise ConversionError(
                f"HF config: {field}={cfg.get(field)!r} makes layers {[i for i, s in enumerate(pattern) if not s]} "
                "dense; only every layer sparse (decoder_sparse_step=1, mlp_only_layers=[]) is supported"
            )
        num_experts = _num_experts(cfg)
        topk = cfg.get("num_experts_per_tok")
        if not isinstance(topk, int) or isinstance(topk, bool) or not 1 <= topk <= num_experts:
            raise ConversionError(f"HF config: num_experts_per_tok={topk!r} must be an integer in [1, {num_experts}]")
        width = cfg.get("moe_intermediate_size")
        if not isinstance(width, int) or isinstance(width, bool) or width < 1:
            raise ConversionError(f"HF config: moe_intermediate_size={width!r} must be a positive integer")
        norm = cfg.get("norm_topk_prob", _DEFAULT_NORM_TOPK_PROB)
        if not isinstance(norm, bool):
            raise ConversionError(f"HF config: norm_topk_prob={norm!r} must be true or false")
        coef = cfg.get("router_aux_loss_coef", _DEFAULT_ROUTER_AUX_LOSS_COEF)
        if isinstance(coef, bool) or not isinstance(coef, (int, float)) or coef < 0:
            raise ConversionError(f"HF config: router_aux_loss_coef={coef!r} must be a number >= 0")
        return MoEDims(
            num_moe_experts=num_experts,
            moe_router_topk=topk,
            moe_ffn_hidden_size=width,
            norm_topk_prob=norm,
            router_aux_loss_coef=float(coef),
        )

    def transformer_config_kwargs(self, hf_config: Any, *, use_te: bool | None = None) -> dict[str, Any]:
        """Architecture keyword arguments for ``TransformerConfig``, MoE fields included.

        ``use_te``: whether the model is built with the Transformer-Engine spec (as in
        :meth:`layer_spec`; None: where TE imports on a CUDA machine), which sets
        ``moe_grouped_gemm``. The token dispatcher is ``alltoall``, the one megatron allows
        with ``variable_seq_lengths``; on a CPU-only torch it needs the CPU shim
        (``megatron_rl.actor.compat.cpu_shim.apply``: it creates a CUDA side stream when
        built), and a forward at expert parallelism 2 runs on gloo
        (tests/distributed/test_convert_moe.py).
        """
        m = self.moe_dims(hf_config)
        if use_te is None:
            use_te = _te_available()
        kwargs = super().transformer_config_kwargs(hf_config)
        kwargs.update(
            num_moe_experts=m.num_moe_experts,
            moe_router_topk=m.moe_router_topk,
            moe_ffn_hidden_size=m.moe_ffn_hidden_size,
            moe_router_score_function="softmax",
            # norm_topk_prob=true is megatron's default order (top-k logits, then softmax);
            # false is softmax over all experts first (see the module doc).
            moe_router_pre_softmax=not m.norm_topk_prob,
            moe_layer_freq=1,  # every layer sparse: the only layout moe_dims accepts
            # HF adds router_aux_loss_coef * loss to the LM loss only when
            # output_router_logits=true (false in the released Qwen3-MoE configs), and its
            # loss pools all layers: E * sum_i f_i * P_i over every layer's tokens, f_i the
            # fraction of top-k assignments to expert i (not divided by k), P_i the mean
            # router probability. megatron's "aux_loss" is the same Switch-Transformer loss
            # per layer and micro-batch with f_i divided by k, summed over layers, so one
            # coefficient weighs it about num_layers / k times as much as HF does. It acts
            # in training only (not on logits); a run sets moe_aux_loss_coeff through
            # model.transformer_config_overrides to change it (0 turns it off).
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=m.router_aux_loss_coef,
            moe_token_dispatcher_type="alltoall",
            moe_grouped_gemm=bool(use_te),
        )
        return kwargs

    # -- spec ----------------------------------------------------------------

    def layer_spec(self, hf_config: Any = None, *, use_te: bool | None = None, sequence_parallel: bool = False):
        """The MoE decoder-layer ``ModuleSpec`` (every layer; see :class:`DecoderAdapter`).

        Local spec: experts are a ``SequentialMLP`` (one local-linear MLP per expert, run
        one after the other; no grouped GEMM without TE), the router is
        :func:`torch_gating_router`'s (megatron-core 0.16.1's own needs TE). Build the model,
        then call :meth:`finish_model` on it. The layer keeps
        the pre-MLP norm under its own checkpoint key, ``decoder.layers.pre_mlp_layernorm.weight``,
        the key of megatron's TE MoE layer: megatron's local spec maps it onto
        ``mlp.linear_fc1.layer_norm_weight`` (right for a dense MLP, whose TE ``linear_fc1``
        holds that norm), which would make local and TE MoE checkpoints differ.
        """
        if hf_config is None:
            raise TypeError("MoEDecoderAdapter.layer_spec needs the HF config (the number of experts)")
        m = self.moe_dims(hf_config)
        if use_te is None:
            use_te = _te_available()
        from megatron.core.models.gpt import gpt_layer_specs

        if use_te:
            return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
                num_experts=m.num_moe_experts, moe_grouped_gemm=True, qk_layernorm=self.qk_norm
            )
        spec = gpt_layer_specs.get_gpt_layer_local_spec(
            num_experts=m.num_moe_experts, moe_grouped_gemm=False, qk_layernorm=self.qk_norm, normalization="RMSNorm"
        )
        spec = _local_spec(spec, qk_norm=self.qk_norm, sequence_parallel=sequence_parallel)
        layer = spec.submodules
        keys = {k: v for k, v in layer.sharded_state_dict_keys_map.items() if k != "pre_mlp_layernorm."}
        layer = dataclasses.replace(
            layer,
            mlp=_with_router(layer.mlp, torch_gating_router()),
            sharded_state_dict_keys_map=keys,
        )
        return dataclasses.replace(spec, submodules=layer)

    def finish_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Adjust a built ``GPTModel`` of this architecture to the machine; returns it.

        On a CPU-only torch each MoE layer's all-to-all token dispatcher gets a subclass
        that hands ``all_to_all_single`` its split sizes as NumPy arrays: megatron copies them
        to the host with ``maybe_move_tensor_to_cpu(..., as_numpy=True)``, which converts
        only CUDA tensors, and gloo's all-to-all refuses tensor split sizes at expert
        parallelism > 1. The subclass only overrides that method, so switching the class of
        megatron's dispatcher keeps its state (its constructor's arguments differ between
        megatron-core releases). With CUDA nothing changes.
        """
        if torch.cuda.is_available():
            return model
        from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

        for module in model.modules():
            dispatcher = getattr(module, "token_dispatcher", None)
            if type(dispatcher) is MoEAlltoAllTokenDispatcher:
                dispatcher.__class__ = _host_splits_dispatcher()
        return model

    # -- weights -------------------------------------------------------------

    def mlp_units(self, hf_config: Any, d: ModelDims, layer: int) -> list[WeightUnit]:
        """Layer ``layer``'s pre-MLP norm, router and experts (expert 0 to E-1, fc1 before fc2).

        Expert units carry the global expert index ``expert=j`` and ``num_experts=E``;
        their ``mcore_name`` uses j as the local index, which holds at expert parallelism 1
        (with EP, rank r holds experts ``r*E/EP .. (r+1)*E/EP - 1`` as ``local_experts.0..``).
        The dist-checkpoint does not depend on EP: expert j of layer i is element ``[i, j]``
        of ``sharded_key`` (:func:`~megatron_rl.models.weight_units.checkpoint_region`).
        """
        m = self.moe_dims(hf_config)
        H, E, F = d.hidden_size, m.num_moe_experts, m.moe_ffn_hidden_size
        units = [
            layer_unit(layer, "copy", "pre_mlp_layernorm.weight", ["post_attention_layernorm.weight"], [(H,)], (H,)),
            layer_unit(layer, "copy", "mlp.router.weight", ["mlp.gate.weight"], [(E, H)], (E, H)),
        ]
        for j in range(E):
            hf, local = f"mlp.experts.{j}.", f"mlp.experts.local_experts.{j}."
            # megatron checkpoints every expert of a layer under one key, with an expert axis.
            units.append(
                layer_unit(
                    layer,
                    "gate_up",
                    local + "linear_fc1.weight",
                    [hf + "gate_proj.weight", hf + "up_proj.weight"],
                    [(F, H), (F, H)],
                    (2 * F, H),
                    sharded_suffix="mlp.experts.experts.linear_fc1.weight",
                    expert=j,
                    num_experts=E,
                )
            )
            units.append(
                layer_unit(
                    layer,
                    "copy",
                    local + "linear_fc2.weight",
                    [hf + "down_proj.weight"],
                    [(H, F)],
                    (H, F),
                    sharded_suffix="mlp.experts.experts.linear_fc2.weight",
                    expert=j,
                    num_experts=E,
                )
            )
        return units

    def canonical_mcore_name(self, name: str) -> str:
        """The unit name of a GPTModel parameter name (global layer index) of either spec.

        Like the dense decoders' (``input_layernorm.`` -> ``self_attention.linear_qkv.layer_norm_``),
        except that ``pre_mlp_layernorm.`` keeps its name (a MoE layer has no ``linear_fc1``)
        and Transformer-Engine grouped expert weights ``mlp.experts.linear_fc1.weight<j>``
        become ``mlp.experts.local_experts.<j>.linear_fc1.weight``.
        """
        if not name.startswith(LAYER_PREFIX):
            return name
        index, _, rest = name[len(LAYER_PREFIX) :].partition(".")
        if rest.startswith("pre_mlp_layernorm."):
            return name
        grouped = _TE_GROUPED_EXPERT.fullmatch(rest)
        if grouped:
            linear, expert = grouped.groups()
            return f"{LAYER_PREFIX}{index}.mlp.experts.local_experts.{expert}.{linear}.weight"
        return canonical_mcore_name(name)
