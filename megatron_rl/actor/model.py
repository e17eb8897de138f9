"""Build a megatron-core ``GPTModel`` (one pipeline stage) from a Hugging Face ``config.json``.

The architecture numbers, layer spec and weight layout come from the per-architecture
adapters in ``megatron_rl.models`` (dispatch on ``model_type``: qwen2 incl. Qwen2.5 with
q/k/v biases and tied or untied embeddings, qwen3 with q/k RMSNorm, llama). This module
adds what the adapters leave to the caller: parallel sizes, dtype, the per-token loss
contract, the CPU flags and Transformer-Engine / FP8 options.

Spec: Transformer-Engine layers on a CUDA machine where ``transformer_engine`` imports,
the local (pure megatron-core) spec otherwise; both give the same checkpoint keys, so a
checkpoint moves between them. FP8 (TE only) is off by default.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from megatron_rl.actor.compat import cpu_shim
from megatron_rl.config.model import ModelOptions
from megatron_rl.config.parallel import ParallelConfig
from megatron_rl.config.trainer import ActorConfig
from megatron_rl.models import DecoderAdapter, adapter_for_config, padded_vocab_size
from megatron_rl.models.common import config_dict

if TYPE_CHECKING:
    from megatron_rl.models.lora import LoRASettings

__all__ = [
    "build_gpt_model",
    "frozen_fp8_scaling",
    "build_transformer_config",
    "layer_spec",
    "load_hf_config",
    "resolve_use_te",
    "te_available",
    "transformer_config_kwargs",
]


def load_hf_config(source: Any) -> dict[str, Any]:
    """A ``config.json`` dict from a HF model directory, a ``config.json`` path, a dict or a
    ``PretrainedConfig``."""
    if isinstance(source, (str, Path)):
        path = Path(source)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"HF config not found: {path}")
        return json.loads(path.read_text())
    return config_dict(source)


def te_available() -> bool:
    """Whether the Transformer-Engine spec can be used: CUDA present and TE importable."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_use_te(options: ModelOptions, *, lora: bool = False, available: bool | None = None) -> bool:
    """Whether the Transformer-Engine spec is used (``model.use_te``, or auto: where TE
    imports on a CUDA machine, unless ``lora``: adapters sit on the local spec's linears);
    a ``ConfigError`` naming the field when TE is asked for (``use_te: true`` or ``fp8``)
    but not available. ``available`` overrides the probe."""
    from megatron_rl.config.lib import ConfigError

    available = te_available() if available is None else available
    use_te = (available and not lora) if options.use_te is None else options.use_te
    if use_te and not available:
        raise ConfigError("model.use_te", "got True; transformer_engine is not importable on a CUDA machine here")
    if options.fp8 is not None and not use_te:
        raise ConfigError(
            "model.fp8", f"got {options.fp8!r}; FP8 needs the Transformer-Engine spec (a CUDA machine with "
            "transformer_engine), which is not available here"
        )  # fmt: skip
    return use_te


def build_transformer_config(
    hf_config: Mapping[str, Any],
    *,
    parallel: ParallelConfig,
    options: ModelOptions,
    actor: ActorConfig | None = None,
):
    """A megatron-core ``TransformerConfig`` for ``hf_config`` at ``parallel``'s sizes.

    Besides the adapter's architecture fields it sets TP/PP and sequence parallelism
    (``parallel``), activation recompute (``actor``), dtype and FP8 (``options``), and:

    * ``calculate_per_token_loss=True``: the loss function returns a SUM and a token count;
      megatron DDP sums gradients over DP (no averaging) and ``finalize_model_grads``
      divides them by the global count (summed over micro-batches, broadcast from the
      last pipeline stage, all-reduced over DP);
    * ``variable_seq_lengths=True``: each micro-batch is trimmed to its own longest
      sequence, and pipeline stages exchange activation shapes before each transfer;
    * ``pipeline_dtype`` equal to the parameter dtype (the CPU layer norm rejects mixed
      dtypes), the CPU flags from ``cpu_shim.transformer_config_overrides()``, FP8 options.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    use_te = resolve_use_te(options, lora=actor is not None and actor.lora is not None)
    return TransformerConfig(**transformer_config_kwargs(hf_config, parallel=parallel, options=options, actor=actor,
                                                         use_te=use_te))  # fmt: skip


def transformer_config_kwargs(
    hf_config: Mapping[str, Any], *, parallel: ParallelConfig, options: ModelOptions, actor: ActorConfig | None,
    use_te: bool,
) -> dict[str, Any]:  # fmt: skip
    """The keyword arguments of :func:`build_transformer_config`'s ``TransformerConfig``."""
    adapter = adapter_for_config(hf_config)
    dtype = options.torch_dtype
    kwargs: dict[str, Any] = dict(adapter.transformer_config_kwargs(hf_config))
    kwargs.update(cpu_shim.transformer_config_overrides())
    kwargs.update(
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        expert_tensor_parallel_size=parallel.resolved_expert_tensor_parallel_size,
        sequence_parallel=parallel.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        calculate_per_token_loss=True,
        variable_seq_lengths=True,
        # The one dispatcher that takes variable lengths (checked even for dense models); on
        # a CPU its host copies run on the CPU shim's stream stand-in.
        moe_token_dispatcher_type="alltoall",
    )
    if options.fp8 is not None:
        kwargs.update(
            fp8=options.fp8,
            fp8_recipe=options.fp8_recipe,
            fp8_margin=options.fp8_margin,
            fp8_amax_history_len=options.fp8_amax_history_len,
            fp8_amax_compute_algo=options.fp8_amax_compute_algo,
        )
    if actor is not None and actor.recompute_granularity != "none":
        kwargs.update(recompute_granularity=actor.recompute_granularity)
        if actor.recompute_granularity == "full":
            kwargs.update(recompute_method=actor.recompute_method, recompute_num_layers=actor.recompute_num_layers)
    if not use_te:
        # The local spec has no fused kernels for these even on CUDA.
        kwargs.update(gradient_accumulation_fusion=False)
    kwargs.update(options.transformer_config_overrides)
    return kwargs


def layer_spec(
    adapter: DecoderAdapter, hf_config: Mapping[str, Any], transformer_config, *, use_te: bool, lora: LoRASettings | None = None
):
    """The decoder spec of this pipeline stage: the adapter's layer spec (with ``lora``, its
    targeted linears carrying adapters: ``models.lora.with_lora``), or with sequence
    parallelism on the local spec, a block spec whose every norm supports it (megatron's
    local norm refuses sequence parallelism)."""
    sequence_parallel = bool(transformer_config.sequence_parallel)
    spec = adapter.layer_spec(hf_config, use_te=use_te, sequence_parallel=sequence_parallel)
    if lora is not None:
        from megatron_rl.models.lora import with_lora

        spec = with_lora(spec, lora)
    if use_te or not sequence_parallel:
        return spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    from megatron_rl.models.norms import SequenceParallelRMSNorm

    num_layers = get_num_layers_to_build(transformer_config)
    return TransformerBlockSubmodules(layer_specs=[spec] * num_layers, layer_norm=SequenceParallelRMSNorm)


def build_gpt_model(
    hf_config: Mapping[str, Any],
    transformer_config,
    *,
    pre_process: bool,
    post_process: bool,
    options: ModelOptions,
    adapter: DecoderAdapter | None = None,
    lora: LoRASettings | None = None,
):
    """The ``GPTModel`` of one pipeline stage (``pre_process``: embedding; ``post_process``:
    final norm + output layer), vocabulary padded for TP; with ``lora``, adapters built in
    and initialised and every other parameter frozen (``models.lora.init_lora``).

    The output layer keeps its logits vocab-parallel (``parallel_output=True``): the loss
    is the fused vocab-parallel op, which never gathers the vocabulary. Parameters are
    cast to ``options.dtype`` after construction (as Megatron-LM's ``Float16Module``
    does); RoPE frequencies are not parameters and stay float32.
    """
    from megatron.core.models.gpt import GPTModel

    adapter = adapter or adapter_for_config(hf_config)
    use_te = resolve_use_te(options, lora=lora is not None)
    vocab = padded_vocab_size(
        int(hf_config["vocab_size"]),
        tp_size=transformer_config.tensor_model_parallel_size,
        divisible_by=options.make_vocab_size_divisible_by,
    )
    # Tied embeddings with PP > 1 call .cuda() on the output weight at construction.
    with cpu_shim.cuda_to_cpu():
        model = GPTModel(
            config=transformer_config,
            transformer_layer_spec=layer_spec(adapter, hf_config, transformer_config, use_te=use_te, lora=lora),
            pre_process=pre_process,
            post_process=post_process,
            parallel_output=True,
            **adapter.gpt_model_kwargs(hf_config, padded_vocab_size=vocab),
        )
    model = adapter.finish_model(model)
    if lora is not None:
        from megatron_rl.models.lora import init_lora

        init_lora([model])
    if options.torch_dtype != torch.float32:
        model = model.to(options.torch_dtype)
    if torch.cuda.is_available():
        model = model.cuda(torch.cuda.current_device())
    return model


@contextlib.contextmanager
def frozen_fp8_scaling(modules: Iterable[torch.nn.Module], *, options: ModelOptions) -> Iterator[None]:
    """Keep delayed FP8 scaling where it is across a forward-only pass of a trained policy.

    With the ``delayed`` recipe every FP8 forward records its amaxes and moves the scales
    (Transformer Engine updates them when the autocast ends). The policy's old-log-prob
    pass would then leave the first mini-batch's training forward other scales than it
    used, and that mini-batch's ratio would not be exactly 1. Each Transformer-Engine
    module's scaling state (``get_extra_state``: scales and amax history, what a
    checkpoint stores) is taken before the pass and put back after it, so the pass
    observes and changes nothing. The current-scaling recipes (``tensorwise``, ``mxfp8``,
    ``blockwise``) keep no history: nothing to freeze. A module whose FP8 state does not
    exist yet (before its first FP8 forward) has nothing to restore.

    ``modules``: the policy's model chunks (every TE module below them is frozen: any
    ``nn.Module`` with an ``fp8_meta`` dict and ``get_extra_state``/``set_extra_state``).
    """
    if options.fp8 is None or options.fp8_recipe != "delayed":
        yield
        return
    saved = [
        (module, module.get_extra_state())
        for chunk in modules
        for module in chunk.modules()
        if isinstance(getattr(module, "fp8_meta", None), dict) and hasattr(module, "set_extra_state")
    ]
    try:
        yield
    finally:
        for module, state in saved:
            module.set_extra_state(state)
