"""The ``model`` section: the architecture (a HF config or the inline tiny one), the initial
weights, and the numerics of the actor (dtype, Transformer Engine, FP8)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from megatron_rl.config.lib import (
    ConfigError,
    check_literals,
    require_range,
)


def require_positive_ints(obj: Any, *names: str) -> None:
    """Raise unless each named int field of ``obj`` is >= 1."""
    for name in names:
        require_range(name, getattr(obj, name), ge=1)


@dataclass(kw_only=True)
class TinyModelConfig:
    """An inline Hugging Face-style architecture for small CPU runs (random init, no files).

    Field names follow the HF ``config.json`` keys (``num_layers`` is HF's
    ``num_hidden_layers``); ``to_hf_config_dict()`` gives the equivalent ``config.json``, so
    the same builder serves it and a real checkpoint's config.
    """

    model_type: str = "qwen2"
    """HF ``model_type``; picks the ``models/<arch>/`` spec and weight adapter (a registered
    adapter: qwen2, qwen3, llama, and qwen3_moe with ``num_experts`` > 0; checked against
    the registry when the run starts)."""

    hidden_size: int = 64
    """Width of the residual stream."""

    num_layers: int = 2
    """Number of transformer layers (HF ``num_hidden_layers``)."""

    num_attention_heads: int = 4
    """Query heads; must divide ``hidden_size``."""

    num_key_value_heads: int = 2
    """Key/value heads (grouped-query attention); must divide ``num_attention_heads``."""

    intermediate_size: int = 128
    """Hidden width of the MLP (SwiGLU); a mixture of experts writes it to its config but,
    with every layer sparse, uses ``moe_intermediate_size``."""

    vocab_size: int = 512
    """Vocabulary size; must cover the tokenizer's ids."""

    max_position_embeddings: int = 512
    """Longest sequence (prompt + response tokens) the model accepts."""

    rope_theta: float = 10000.0
    """Base of the rotary position embedding."""

    rms_norm_eps: float = 1e-6
    """Epsilon of the RMSNorm layers."""

    tie_word_embeddings: bool = True
    """Share the input embedding with the output layer (as small Qwen2 models do)."""

    num_experts: int = 0
    """Routed experts of every layer's MLP (mixture of experts, ``model_type: qwen3_moe``);
    0: a dense MLP of ``intermediate_size``."""

    num_experts_per_tok: int = 2
    """Experts each token is routed to (top-k); at most ``num_experts``."""

    moe_intermediate_size: int = 64
    """Hidden width of one expert's SwiGLU MLP."""

    norm_topk_prob: bool = True
    """Whether a token's top-k routing weights are renormalised to sum to 1."""

    router_aux_loss_coef: float = 0.001
    """Coefficient of the router's load-balancing loss (docs/moe.md: how megatron applies it)."""

    def __post_init__(self) -> None:
        check_literals(self)
        if not self.model_type:
            raise ConfigError("model_type", "got ''; must name a registered model adapter (e.g. qwen2)")
        require_positive_ints(
            self, "hidden_size", "num_layers", "num_attention_heads", "num_key_value_heads",
            "intermediate_size", "vocab_size", "max_position_embeddings",
        )  # fmt: skip
        require_range("num_experts", self.num_experts, ge=0, le=1024)
        require_range("router_aux_loss_coef", self.router_aux_loss_coef, ge=0.0)
        if (self.num_experts > 0) != (self.model_type == "qwen3_moe"):
            raise ConfigError(
                "num_experts",
                f"got {self.num_experts} with model_type {self.model_type!r}; qwen3_moe needs experts (> 0), "
                "the dense types none (0)",
            )
        if not self.num_experts:
            # A dense model has no experts to read these: set, they would be ignored.
            for name in ("num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "router_aux_loss_coef"):
                if getattr(self, name) != TinyModelConfig.__dataclass_fields__[name].default:
                    raise ConfigError(name, f"got {getattr(self, name)!r}; only a mixture of experts (num_experts > 0) reads it")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(
                "num_experts_per_tok", f"got {self.num_experts_per_tok}; must be in [1, num_experts = {self.num_experts}]"
            )
        require_range("moe_intermediate_size", self.moe_intermediate_size, ge=1, le=1 << 16)
        require_range("rope_theta", self.rope_theta, gt=0.0)
        require_range("rms_norm_eps", self.rms_norm_eps, gt=0.0, lt=1.0)
        for name, most in (("hidden_size", 1 << 16), ("num_layers", 1024), ("num_attention_heads", 1024),
                           ("num_key_value_heads", 1024), ("intermediate_size", 1 << 18), ("vocab_size", 1 << 22),
                           ("max_position_embeddings", 1 << 22)):  # fmt: skip
            require_range(name, getattr(self, name), ge=1, le=most)  # the inline model is for small runs
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                "num_attention_heads",
                f"got {self.num_attention_heads}; must divide hidden_size ({self.hidden_size})",
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                "num_key_value_heads",
                f"got {self.num_key_value_heads}; must divide num_attention_heads ({self.num_attention_heads})",
            )

    def to_hf_config_dict(self) -> dict[str, Any]:
        """The equivalent HF ``config.json`` content (keys as ``transformers`` names them).

        Qwen3 types get ``head_dim`` written out (``hidden_size / num_attention_heads``):
        transformers' Qwen3 configs default it to 128 otherwise, and the engine would build that."""
        moe = {}
        if self.num_experts:
            moe = {
                "num_experts": self.num_experts,
                "num_experts_per_tok": self.num_experts_per_tok,
                "moe_intermediate_size": self.moe_intermediate_size,
                "norm_topk_prob": self.norm_topk_prob,
                "router_aux_loss_coef": self.router_aux_loss_coef,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
            }
        if self.model_type in ("qwen3", "qwen3_moe"):
            moe["head_dim"] = self.hidden_size // self.num_attention_heads
        return {
            **moe,
            "model_type": self.model_type,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
        }


@dataclass(kw_only=True)
class ModelOptions:
    """Numerics of the actor model: precision, kernels, FP8 (the architecture comes elsewhere).

    These are the fields of the ``model`` section that the Megatron actor reads; the
    section's class extends this one, so each is declared once and the actor receives the
    section itself.
    """

    dtype: Literal["float32", "bfloat16"] | None = None
    """Parameter and compute dtype of the actor; null: ``bfloat16`` for a HF model,
    ``float32`` for the inline tiny one. Gradients are reduced and the optimizer keeps its
    master weights and moments in float32 in both cases."""

    use_te: bool | None = None
    """Transformer-Engine layer spec: null picks it on CUDA when ``transformer_engine``
    imports, else megatron-core's local spec; true without TE fails when the actor is built."""

    fp8: Literal["e4m3", "hybrid"] | None = None
    """FP8 GEMMs (TE spec only): ``e4m3`` everywhere, or ``hybrid`` (e4m3 forward, e5m2
    gradients); null disables FP8."""

    fp8_recipe: Literal["delayed", "tensorwise", "mxfp8", "blockwise"] = "delayed"
    """FP8 scaling recipe passed to megatron-core (``delayed`` = TE DelayedScaling)."""

    fp8_margin: int = 0
    """Scaling-factor margin (powers of two) of the delayed recipe."""

    fp8_amax_history_len: int = 1024
    """Length of the amax history window of the delayed recipe."""

    fp8_amax_compute_algo: Literal["most_recent", "max"] = "max"
    """How the scale is derived from the amax history."""

    make_vocab_size_divisible_by: int = 128
    """Embedding / output rows are padded to a multiple of this times TP (Megatron-LM
    convention; padding rows never enter the loss and are stripped on export)."""

    transformer_config_overrides: dict[str, Any] = field(default_factory=dict)
    """Extra megatron-core ``TransformerConfig`` keyword arguments passed through unchanged;
    applied last."""

    def __post_init__(self) -> None:
        check_literals(self)
        if self.fp8 is not None and self.use_te is False:
            raise ConfigError("fp8", f"got {self.fp8!r}; FP8 needs the Transformer-Engine spec but use_te is false")
        require_range("fp8_amax_history_len", self.fp8_amax_history_len, ge=1, le=1 << 16)
        require_range("fp8_margin", self.fp8_margin, ge=0, le=64)
        require_range("make_vocab_size_divisible_by", self.make_vocab_size_divisible_by, ge=1, le=1 << 16)

    @property
    def torch_dtype(self):
        """``dtype`` as a ``torch.dtype`` (imports torch); float32 when unresolved."""
        import torch

        return {"float32": torch.float32, "bfloat16": torch.bfloat16, None: torch.float32}[self.dtype]


@dataclass(kw_only=True)
class ModelConfig(ModelOptions):
    """The policy model: its architecture (a HF config or the inline ``tiny`` one), weights
    and numerics.

    Exactly one of ``hf_config`` and ``tiny`` is set. When the whole ``model`` section is
    left out, the run uses the default ``tiny`` model.
    """

    hf_config: str | None = None
    """Path to a Hugging Face model directory or its ``config.json``; the architecture is
    read from it and dispatched on its ``model_type``. Exclusive with ``tiny``."""

    tiny: TinyModelConfig | None = None
    """Inline architecture for small CPU runs, used instead of ``hf_config``."""

    tokenizer: str | None = None
    """Path to a HF tokenizer directory; null uses the tokenizer next to ``hf_config``
    (or ``checkpoint``)."""

    init: Literal["random", "pretrained"] = "random"
    """``random``: fresh weights from the seed; ``pretrained``: load ``checkpoint`` (or the
    weights in the ``hf_config`` directory when ``checkpoint`` is null)."""

    checkpoint: str | None = None
    """Weights to start from: a HF safetensors directory or a Megatron distributed
    checkpoint (see ``megatron-rl convert``). Only with ``init: pretrained`` (an error otherwise)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if (self.hf_config is None) == (self.tiny is None):
            state = "both are set" if self.tiny is not None else "neither is set"
            raise ConfigError("hf_config", f"set exactly one of model.hf_config and model.tiny; {state}")
        if self.init == "pretrained" and self.checkpoint is None and self.hf_config is None:
            raise ConfigError("checkpoint", "got None; init 'pretrained' with a tiny model needs a checkpoint to load")
        if self.init == "random" and self.checkpoint is not None:
            # An error, not a warning: a run meant to start from an SFT or converted
            # checkpoint would otherwise train a random model to the end.
            raise ConfigError("checkpoint", f"{self.checkpoint!r} would be ignored: init is 'random'; set "
                                            "model.init: pretrained to start from it, or leave model.checkpoint unset")  # fmt: skip
        if self.dtype is None:  # resolved here, so the saved config says what ran
            self.dtype = "float32" if self.tiny is not None else "bfloat16"

    @property
    def initial_weights(self) -> str | None:
        """Where the initial weights are read from (a HF directory or a Megatron
        checkpoint), or ``None`` for a random init."""
        if self.init == "random":
            return None
        return self.checkpoint or self.hf_config
