"""HF <-> Megatron mapping shared by the Llama-family decoders (Qwen2/2.5, Qwen3, Llama).

The three architectures differ only in a few flags (Qwen2 q/k/v biases, Qwen3 q/k
RMSNorm), so one :class:`DecoderAdapter` does the work and ``models/<arch>/`` only
declares the flags and the config checks. Nothing here imports megatron-core at module
level; ``layer_spec`` imports it when called.

The weight layout (which HF tensors make which Megatron parameter) lives in
:mod:`megatron_rl.models.weight_units`.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from megatron_rl.models.weight_units import (
    LAYER_PREFIX,
    ConversionError,
    WeightUnit,
    canonical_mcore_name,
    hf_to_mcore,
    mcore_to_hf,
)

__all__ = [
    "ModelDims",
    "DecoderAdapter",
    "config_dict",
    "layer_unit",
    "padded_vocab_size",
    "require_false",
    "require_no_sliding_window",
]


# ----------------------------------------------------------------------------- config


def config_dict(hf_config: Any) -> dict[str, Any]:
    """A plain dict from a transformers ``PretrainedConfig`` or a parsed ``config.json``."""
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    to_dict = getattr(hf_config, "to_dict", None)
    if to_dict is None:
        raise TypeError(f"expected a PretrainedConfig or a config.json dict, got {type(hf_config).__name__}")
    return to_dict()


def _field(cfg: Mapping[str, Any], key: str) -> Any:
    value = cfg.get(key)
    if value is None:
        raise ConversionError(f"HF config: required field '{key}' is missing")
    return value


def padded_vocab_size(vocab_size: int, *, tp_size: int, divisible_by: int = 128) -> int:
    """Vocabulary size rounded up to a multiple of ``divisible_by * tp_size``.

    Megatron splits the embedding and output layer by rows across TP ranks, so the row
    count must divide by TP; the extra multiple keeps the shards GEMM-friendly (the
    Megatron-LM convention). Padding rows are zeros and are stripped on export.
    """
    if vocab_size <= 0 or tp_size <= 0 or divisible_by <= 0:
        raise ValueError(f"vocab_size, tp_size and divisible_by must be positive, got {vocab_size}, {tp_size}, {divisible_by}")
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


def _rope(cfg: Mapping[str, Any]) -> tuple[float, float | None]:
    """(rope theta, llama3 scaling factor or None) from either HF config layout.

    transformers >= 5 writes ``rope_parameters: {rope_type, rope_theta, ...}``; older
    config.json files have top-level ``rope_theta`` and ``rope_scaling``.
    """
    params = cfg.get("rope_parameters")
    if isinstance(params, Mapping):
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling: Mapping[str, Any] | None = params
    else:
        theta = cfg.get("rope_theta", 10000.0)
        scaling = cfg.get("rope_scaling")
    rope_type = None
    if scaling:
        rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type in (None, "default"):
        return float(theta), None
    if rope_type == "llama3":
        # megatron-core's RotaryEmbedding hard-codes the other llama3 constants.
        expected = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        for key, value in expected.items():
            if float(scaling.get(key, value)) != float(value):
                raise ConversionError(
                    f"HF config: llama3 rope scaling with {key}={scaling.get(key)} is not supported "
                    f"(megatron-core implements {key}={value} only)"
                )
        return float(theta), float(scaling["factor"])
    raise ConversionError(f"HF config: rope_type '{rope_type}' is not supported (supported: default, llama3)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelDims:
    """Architecture numbers read from an HF config (names follow megatron-core)."""

    model_type: str
    num_layers: int
    hidden_size: int
    """H."""
    ffn_hidden_size: int
    """F, the width of gate/up (``intermediate_size``)."""
    num_attention_heads: int
    """nh, query heads."""
    num_query_groups: int
    """ng, key/value heads (``num_key_value_heads``)."""
    head_dim: int
    """d (``kv_channels`` in Megatron); not always H / nh (Qwen3)."""
    vocab_size: int
    """V, rows of the HF embedding (before TP padding)."""
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    rms_norm_eps: float
    rope_theta: float
    rope_scaling_factor: float | None
    """llama3-style frequency scaling factor; None without scaling."""
    max_position_embeddings: int
    initializer_range: float
    attention_dropout: float


# ----------------------------------------------------------------------------- checks


def require_false(key: str, reason: str) -> Callable[[Mapping[str, Any]], None]:
    """A config check that rejects ``cfg[key]`` being truthy (features Megatron lacks here)."""

    def check(cfg: Mapping[str, Any]) -> None:
        if cfg.get(key):
            raise ConversionError(f"HF config: {key}={cfg[key]!r} is not supported: {reason}")

    return check


def require_no_sliding_window(cfg: Mapping[str, Any]) -> None:
    """Reject sliding-window attention (the GPTModel built here attends to the full context)."""
    if cfg.get("use_sliding_window"):
        raise ConversionError("HF config: use_sliding_window=true is not supported (full causal attention only)")


def _check_common(cfg: Mapping[str, Any]) -> None:
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ConversionError(f"HF config: hidden_act={act!r} is not supported (SwiGLU with silu only)")


# ----------------------------------------------------------------------------- adapter


def _te_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        importlib.import_module("transformer_engine")
    except ImportError:
        return False
    return True


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoderAdapter:
    """HF <-> Megatron adapter for one Llama-family ``model_type``.

    Typical use::

        adapter = get_adapter(cfg["model_type"])
        config = TransformerConfig(**adapter.transformer_config_kwargs(cfg), tensor_model_parallel_size=tp, ...)
        model = GPTModel(config, adapter.layer_spec(cfg), **adapter.gpt_model_kwargs(cfg, padded_vocab_size=vp), ...)
        units = adapter.weight_units(cfg, padded_vocab_size=vp)
        full = adapter.hf_to_mcore(unit, {name: hf_tensor(name) for name in unit.hf_names})
        pairs = adapter.mcore_to_hf(unit, full_tensor)       # [(hf_name, tensor), ...]
    """

    model_type: str
    qk_norm: bool
    """Per-head RMSNorm on queries and keys (Qwen3's ``q_norm`` / ``k_norm``)."""
    qkv_bias: Callable[[Mapping[str, Any]], bool]
    """Whether q/k/v projections carry biases, from the config dict."""
    checks: tuple[Callable[[Mapping[str, Any]], None], ...] = ()
    """Config checks raising :class:`ConversionError` for unsupported features."""
    architecture: str | None = None
    """The HF ``architectures`` class name of this ``model_type`` (``Qwen2ForCausalLM``), for
    a ``config.json`` written without one; ``None`` when the adapter does not say."""
    not_yet: str | None = None
    """What training (the actor, weight sync, the engines) cannot do with this architecture
    yet, said by the pre-flight when it refuses the run; ``None``: nothing."""

    hf_to_mcore = staticmethod(hf_to_mcore)
    mcore_to_hf = staticmethod(mcore_to_hf)

    # -- config --------------------------------------------------------------

    def dims(self, hf_config: Any) -> ModelDims:
        """Validate the config and read the architecture numbers."""
        cfg = config_dict(hf_config)
        model_type = cfg.get("model_type")
        if model_type != self.model_type:
            raise ConversionError(f"HF config: model_type={model_type!r}, but this adapter is for {self.model_type!r}")
        _check_common(cfg)
        for check in self.checks:
            check(cfg)
        hidden = int(_field(cfg, "hidden_size"))
        heads = int(_field(cfg, "num_attention_heads"))
        groups = int(cfg.get("num_key_value_heads") or heads)
        head_dim = cfg.get("head_dim")
        if head_dim is None:
            if hidden % heads:
                raise ConversionError(f"HF config: hidden_size={hidden} is not divisible by num_attention_heads={heads}")
            head_dim = hidden // heads
        if heads % groups:
            raise ConversionError(f"HF config: num_attention_heads={heads} is not divisible by num_key_value_heads={groups}")
        theta, scaling = _rope(cfg)
        return ModelDims(
            model_type=self.model_type,
            num_layers=int(_field(cfg, "num_hidden_layers")),
            hidden_size=hidden,
            ffn_hidden_size=int(_field(cfg, "intermediate_size")),
            num_attention_heads=heads,
            num_query_groups=groups,
            head_dim=int(head_dim),
            vocab_size=int(_field(cfg, "vocab_size")),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(self.qkv_bias(cfg)),
            qk_norm=self.qk_norm,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling_factor=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            initializer_range=float(cfg.get("initializer_range", 0.02)),
            attention_dropout=float(cfg.get("attention_dropout", 0.0) or 0.0),
        )

    def transformer_config_kwargs(self, hf_config: Any) -> dict[str, Any]:
        """Architecture keyword arguments for megatron-core ``TransformerConfig``.

        Parallelism, dtype and CPU/fusion flags are the caller's (see
        ``megatron_rl.actor.compat.cpu_shim.transformer_config_overrides`` on CPU).
        """
        import torch.nn.functional as F

        d = self.dims(hf_config)
        return {
            "num_layers": d.num_layers,
            "hidden_size": d.hidden_size,
            "ffn_hidden_size": d.ffn_hidden_size,
            "num_attention_heads": d.num_attention_heads,
            "num_query_groups": d.num_query_groups,
            "kv_channels": d.head_dim,
            "normalization": "RMSNorm",
            "layernorm_epsilon": d.rms_norm_eps,
            "gated_linear_unit": True,  # SwiGLU: linear_fc1 = [gate; up]
            "activation_func": F.silu,
            "add_bias_linear": False,
            "add_qkv_bias": d.qkv_bias,
            "qk_layernorm": d.qk_norm,
            "rotary_interleaved": False,  # HF rotates halves, not interleaved pairs
            "hidden_dropout": 0.0,
            "attention_dropout": d.attention_dropout,
            "init_method_std": d.initializer_range,
        }

    def gpt_model_kwargs(self, hf_config: Any, *, padded_vocab_size: int) -> dict[str, Any]:
        """``GPTModel`` keyword arguments (everything but config, spec and pre/post_process)."""
        d = self.dims(hf_config)
        if padded_vocab_size < d.vocab_size:
            raise ValueError(f"padded_vocab_size={padded_vocab_size} < vocab_size={d.vocab_size}")
        theta = int(d.rope_theta) if float(d.rope_theta).is_integer() else d.rope_theta
        return {
            "vocab_size": padded_vocab_size,
            "max_sequence_length": d.max_position_embeddings,
            "position_embedding_type": "rope",
            "rotary_percent": 1.0,
            "rotary_base": theta,
            "rope_scaling": d.rope_scaling_factor is not None,
            "rope_scaling_factor": d.rope_scaling_factor if d.rope_scaling_factor is not None else 8.0,
            "share_embeddings_and_output_weights": d.tie_word_embeddings,
        }

    def layer_spec(self, hf_config: Any = None, *, use_te: bool | None = None, sequence_parallel: bool = False):
        """The decoder-layer ``ModuleSpec``.

        ``use_te=None`` picks the Transformer-Engine spec only on a CUDA machine where
        ``transformer_engine`` imports, else the local (pure megatron-core) spec. Both
        give the same checkpoint keys. The local spec's core attention is
        :class:`~megatron_rl.models.attention.PackedDotProductAttention` (megatron's, plus
        packed sequences). megatron-core's local norm refuses sequence parallelism, so
        with ``sequence_parallel`` the local spec's norms are
        :class:`~megatron_rl.models.norms.SequenceParallelRMSNorm` (the block's final norm
        must then be one too: the actor builds the block spec).
        """
        if hf_config is not None:
            self.dims(hf_config)  # validate
        if use_te is None:
            use_te = _te_available()
        from megatron.core.models.gpt import gpt_layer_specs

        if use_te:
            return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=self.qk_norm)
        spec = gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=self.qk_norm, normalization="RMSNorm")
        return _local_spec(spec, qk_norm=self.qk_norm, sequence_parallel=sequence_parallel)

    # -- weights -------------------------------------------------------------

    def weight_units(self, hf_config: Any, *, padded_vocab_size: int) -> list[WeightUnit]:
        """Every Megatron parameter of the model in HF order (embedding, layers, norm, lm_head)."""
        d = self.dims(hf_config)
        if padded_vocab_size < d.vocab_size:
            raise ValueError(f"padded_vocab_size={padded_vocab_size} < vocab_size={d.vocab_size}")
        H, dh = d.hidden_size, d.head_dim
        q_rows, kv_rows = d.num_attention_heads * dh, d.num_query_groups * dh
        units = [
            WeightUnit(
                kind="vocab",
                mcore_name="embedding.word_embeddings.weight",
                sharded_key="embedding.word_embeddings.weight",
                layer=None,
                hf_names=("model.embed_tokens.weight",),
                hf_shapes=((d.vocab_size, H),),
                mcore_shape=(padded_vocab_size, H),
            )
        ]
        for i in range(d.num_layers):
            units += _attention_units(d, i, q_rows=q_rows, kv_rows=kv_rows, H=H)
            units += self.mlp_units(hf_config, d, i)
        units.append(
            WeightUnit(
                kind="copy",
                mcore_name="decoder.final_layernorm.weight",
                sharded_key="decoder.final_layernorm.weight",
                layer=None,
                hf_names=("model.norm.weight",),
                hf_shapes=((H,),),
                mcore_shape=(H,),
            )
        )
        if not d.tie_word_embeddings:
            units.append(
                WeightUnit(
                    kind="vocab",
                    mcore_name="output_layer.weight",
                    sharded_key="output_layer.weight",
                    layer=None,
                    hf_names=("lm_head.weight",),
                    hf_shapes=((d.vocab_size, H),),
                    mcore_shape=(padded_vocab_size, H),
                )
            )
        return units

    def mlp_units(self, hf_config: Any, d: ModelDims, layer: int) -> list[WeightUnit]:
        """The units of decoder layer ``layer``'s MLP block, its pre-MLP norm first (HF order).

        The dense SwiGLU MLP here; an adapter with another MLP (mixture of experts,
        :mod:`megatron_rl.models.moe`) overrides it. ``d`` is ``self.dims(hf_config)``.
        """
        return _dense_mlp_units(d, layer)

    def finish_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Adjust a built ``GPTModel`` of this architecture to the machine (after
        construction, before use); returns it. Nothing for the dense decoders."""
        return model

    def canonical_mcore_name(self, name: str) -> str:
        """This architecture's unit name (``WeightUnit.mcore_name``) of a GPTModel parameter
        name with a global layer index; :func:`~megatron_rl.models.weight_units.canonical_mcore_name`
        for the dense decoders, overridden where the local spec's names map otherwise (MoE)."""
        return canonical_mcore_name(name)

    def ignorable_hf_names(self, hf_config: Any) -> Callable[[str], bool]:
        """Predicate for HF tensors that carry no weights of their own.

        Old checkpoints store RoPE ``inv_freq`` buffers; tied checkpoints may store a
        copy of the embedding as ``lm_head.weight``.
        """
        tied = self.dims(hf_config).tie_word_embeddings

        def ignorable(name: str) -> bool:
            return name.endswith(".rotary_emb.inv_freq") or (tied and name == "lm_head.weight")

        return ignorable


def _local_spec(layer_spec, *, qk_norm: bool, sequence_parallel: bool):
    """megatron's local layer spec with the core attention that takes packed sequences and,
    with ``sequence_parallel``, every norm swapped for one that supports it."""
    from megatron_rl.models.attention import PackedDotProductAttention
    from megatron_rl.models.norms import SequenceParallelRMSNorm

    layer = layer_spec.submodules
    attention = layer.self_attention
    attn_sub = dataclasses.replace(attention.submodules, core_attention=PackedDotProductAttention)
    norms = {}
    if sequence_parallel:
        norms = dict(input_layernorm=SequenceParallelRMSNorm, pre_mlp_layernorm=SequenceParallelRMSNorm)
        if qk_norm:  # per-head norms (their grads are summed over TP by name, whatever the attribute)
            attn_sub = dataclasses.replace(attn_sub, q_layernorm=SequenceParallelRMSNorm,
                                           k_layernorm=SequenceParallelRMSNorm)  # fmt: skip
    layer = dataclasses.replace(layer, self_attention=dataclasses.replace(attention, submodules=attn_sub), **norms)
    return dataclasses.replace(layer_spec, submodules=layer)


def layer_unit(
    layer: int,
    kind: str,
    suffix: str,
    hf_suffixes: Sequence[str],
    hf_shapes: Sequence[tuple[int, ...]],
    mcore_shape: tuple[int, ...],
    *,
    sharded_suffix: str | None = None,
    **extra: Any,
) -> WeightUnit:
    """The unit of parameter ``decoder.layers.<layer>.<suffix>`` made of the HF tensors
    ``model.layers.<layer>.<hf_suffix>``; its dist-checkpoint key is
    ``decoder.layers.<sharded_suffix>`` (default: ``suffix``; layers stacked on a leading
    dimension). ``extra``: the other :class:`WeightUnit` fields (``num_query_groups``,
    ``expert``, ...)."""
    hf = f"model.layers.{layer}."
    return WeightUnit(
        kind=kind,
        mcore_name=f"{LAYER_PREFIX}{layer}.{suffix}",
        sharded_key=f"{LAYER_PREFIX}{sharded_suffix or suffix}",
        layer=layer,
        hf_names=tuple(hf + n for n in hf_suffixes),
        hf_shapes=tuple(hf_shapes),
        mcore_shape=mcore_shape,
        **extra,
    )


def _attention_units(d: ModelDims, i: int, *, q_rows: int, kv_rows: int, H: int) -> list[WeightUnit]:
    qkv_names = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    units = [
        layer_unit(i, "copy", "self_attention.linear_qkv.layer_norm_weight", ["input_layernorm.weight"], [(H,)], (H,)),
        layer_unit(
            i,
            "qkv",
            "self_attention.linear_qkv.weight",
            [n + ".weight" for n in qkv_names],
            [(q_rows, H), (kv_rows, H), (kv_rows, H)],
            (q_rows + 2 * kv_rows, H),
            num_query_groups=d.num_query_groups,
        ),
    ]
    if d.qkv_bias:
        units.append(
            layer_unit(
                i,
                "qkv",
                "self_attention.linear_qkv.bias",
                [n + ".bias" for n in qkv_names],
                [(q_rows,), (kv_rows,), (kv_rows,)],
                (q_rows + 2 * kv_rows,),
                num_query_groups=d.num_query_groups,
            )
        )
    if d.qk_norm:
        dh = d.head_dim
        units.append(layer_unit(i, "copy", "self_attention.q_layernorm.weight", ["self_attn.q_norm.weight"], [(dh,)], (dh,)))
        units.append(layer_unit(i, "copy", "self_attention.k_layernorm.weight", ["self_attn.k_norm.weight"], [(dh,)], (dh,)))
    units.append(layer_unit(i, "copy", "self_attention.linear_proj.weight", ["self_attn.o_proj.weight"], [(H, q_rows)], (H, q_rows)))
    return units


def _dense_mlp_units(d: ModelDims, i: int) -> list[WeightUnit]:
    H, F = d.hidden_size, d.ffn_hidden_size
    return [
        layer_unit(i, "copy", "mlp.linear_fc1.layer_norm_weight", ["post_attention_layernorm.weight"], [(H,)], (H,)),
        layer_unit(
            i,
            "gate_up",
            "mlp.linear_fc1.weight",
            ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
            [(F, H), (F, H)],
            (2 * F, H),
        ),
        layer_unit(i, "copy", "mlp.linear_fc2.weight", ["mlp.down_proj.weight"], [(H, F)], (H, F)),
    ]
