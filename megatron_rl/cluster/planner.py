"""Memory planner: predicted bytes per GPU, per component, of a run's actor ranks.

``megatron-rl plan CONFIG [overrides] --gpu-memory-gb 80`` prints, for the worst pipeline
stage, the bytes of: parameters, gradients (megatron DDP's float32 buffer), optimizer
state (Adam moments and float32 master weights, sharded over DP by the distributed
optimizer), activations saved by one micro-batch (x the micro-batches in flight in the
1F1B pipeline schedule), the loss buffers (materialised logits and their gradient, or
the fused lm-head's chunk workspace), the backward pass's largest weight gradient before
it joins the float32 buffer, the optimizer step's temporaries, the reference
policy (resident, or nothing outside its pass when offloaded), and the colocated
rollout engines' share during generation. The training peak is the resident state plus
the larger of the forward-backward's transients and the optimizer step's (never live
together). The total is compared with the GPU memory;
``plan`` exits 1 when it does not fit.

Activation bytes are what a layer saves for the backward pass, measured on the local
spec (megatron's modules, attention through ``scaled_dot_product_attention``, which keeps
no ``[s, s]`` probabilities) with saved-tensor hooks (``benchmarks/saved_activations.py``,
fp32), and fitted at five shapes (docs/actor.md has the table):

    per token per layer:  a * [ 5H / t_sp + (4 n_q d + 3 n_kv d + 5F + n_q) / t + 2d + 2 ]

with ``a`` the activation bytes, ``t`` the TP size, ``t_sp = t`` with sequence
parallelism (norm inputs/outputs sharded) else 1. The parts: the two norms' inputs and
outputs and one more hidden-sized tensor (5H); the QKV projection's output, kept whole
because the values are a view of it ((n_q + 2 n_kv) d), the rotated queries and keys
((n_q + n_kv) d), the attention's output and its reshaped copy (2 n_q d) and its
log-sum-exp per head (n_q); SwiGLU's input (2F), activation, product and one more
F-sized tensor (5F); the rotary tables and norms' statistics (2d + 2). The classic
count (Korthikanti et al. 2022: ``4H + (n_q + 2 n_kv) d + n_q d + 3F`` for this layer
layout) is 0.6x of it. With attention dropout (an HF config's ``attention_dropout``)
megatron's unfused attention runs and keeps the ``[s, s]`` probabilities too (``a n_q
s / t`` more; none with Transformer Engine, nor with selective recompute). ``full``
recompute keeps only each layer's input plus one recompute unit's activations. A
mixture-of-experts MLP replaces ``5F / t`` (:func:`moe_bytes_per_token`, fitted the same
way at three MoE shapes); its experts' parameters are split over EP and their optimizer
state sharded over DP / EP. With LoRA (``actor.lora``) gradients and optimizer state are
the adapters' (:func:`lora_parameters`) and a reference policy costs nothing. The
planner is checked against measured peaks of real train steps on CPU, at the second
step, whose forward-backward runs with Adam's moments resident as every later step's
does (``tests/distributed/test_planner.py``: the plan covers the live peak, at most 25%
above it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_rl.config.lib import ConfigError
from megatron_rl.config.model import ModelConfig, ModelOptions
from megatron_rl.config.parallel import ParallelConfig
from megatron_rl.config.rollout import RolloutConfig
from megatron_rl.config.trainer import ActorConfig, LoRAConfig, TrainerConfig
from megatron_rl.ops.vocab_parallel import chunk_budget_bytes

__all__ = ["Architecture", "MemoryPlan", "lora_parameters", "plan_memory"]

GIB = 1 << 30
# Components live only during the forward-backward pass (the rest is resident, except the
# optimizer step's temporaries, which live only during the step).
_FORWARD_BACKWARD = ("activations", "loss_buffers", "backward_temporaries")


@dataclass(frozen=True, kw_only=True)
class Architecture:
    """The numbers of a decoder the planner needs (from a HF ``config.json``)."""

    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    attention_dropout: float = 0.0
    num_experts: int = 0
    """Routed experts per layer (every layer a mixture of experts); 0: dense MLPs of ``ffn_hidden_size``."""
    moe_ffn_hidden_size: int = 0
    """One expert's SwiGLU width."""
    moe_topk: int = 0
    """Experts per token."""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def parameters(self) -> tuple[int, int]:
        """``(total, active per token)`` parameters of the whole model (one copy of each tensor)."""
        total = stage_parameters(self, tp=1, pp=1, stage=0, divisible_by=1)
        if not self.is_moe:
            return total, total
        idle = (self.num_experts - self.moe_topk) * 3 * self.hidden_size * self.moe_ffn_hidden_size * self.num_layers
        return total, total - idle

    @classmethod
    def of_model(cls, model: ModelConfig) -> Architecture:
        """The architecture of the ``model`` section (the tiny one, or ``hf_config``'s
        ``config.json``: only the config is read); a bad path is a ``ConfigError``."""
        if model.tiny is not None:
            return cls.from_hf_config(model.tiny.to_hf_config_dict())
        path = Path(model.hf_config)
        path = path / "config.json" if path.is_dir() else path
        try:
            return cls.from_hf_config(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError) as e:
            raise ConfigError("model.hf_config", f"cannot read the architecture from {path}: {e}") from None

    @classmethod
    def from_hf_config(cls, hf_config: dict[str, Any]) -> Architecture:
        from megatron_rl.models import adapter_for_config
        from megatron_rl.models.moe import MoEDecoderAdapter

        adapter = adapter_for_config(hf_config)
        dims = adapter.dims(hf_config)
        moe = {}
        if isinstance(adapter, MoEDecoderAdapter):
            m = adapter.moe_dims(hf_config)
            moe = dict(num_experts=m.num_moe_experts, moe_ffn_hidden_size=m.moe_ffn_hidden_size, moe_topk=m.moe_router_topk)
        return cls(
            hidden_size=dims.hidden_size, ffn_hidden_size=dims.ffn_hidden_size, num_layers=dims.num_layers,
            num_attention_heads=dims.num_attention_heads, num_query_groups=dims.num_query_groups,
            head_dim=dims.head_dim, vocab_size=dims.vocab_size, tie_word_embeddings=dims.tie_word_embeddings,
            qkv_bias=dims.qkv_bias, qk_norm=dims.qk_norm, attention_dropout=dims.attention_dropout, **moe,
        )  # fmt: skip


@dataclass(kw_only=True)
class MemoryPlan:
    """Predicted bytes per GPU of the worst pipeline stage, per component."""

    components: dict[str, int] = field(default_factory=dict)
    """Component -> bytes during training (see the module docstring)."""
    generation_bytes: int = 0
    """Bytes during generation: the actor's resident state plus the colocated engines' share."""
    sync_bytes: int = 0
    """Bytes on the sending rank's GPU during a weight sync: what is resident then (the
    weights, plus a colocated engine's woken weights; disaggregated: the training state)
    and :attr:`sync_transient_bytes`."""
    sync_transient_bytes: int = 0
    """What a weight sync adds on the sending rank (:func:`sync_transient_bytes`)."""
    gpu_memory_bytes: int | None = None
    """The GPU's memory, when given."""
    stage: int = 0
    """The pipeline stage the components are for (the one needing most during training;
    ``generation_bytes`` is the largest of any stage)."""
    notes: list[str] = field(default_factory=list)
    """Assumptions worth knowing (e.g. which attention the activations assume)."""

    @property
    def training_bytes(self) -> int:
        """The training peak: the resident state plus the larger of the two phases'
        transients, which are never live together (the forward-backward's activations,
        loss buffers and weight-gradient temporaries are freed before the optimizer step)."""
        c = self.components
        resident = sum(v for k, v in c.items() if k not in _FORWARD_BACKWARD and k != "optimizer_step_temporaries")
        forward_backward = sum(c.get(k, 0) for k in _FORWARD_BACKWARD)
        return resident + max(forward_backward, c.get("optimizer_step_temporaries", 0))

    @property
    def total_bytes(self) -> int:
        """The peak of the three phases (training, weight sync, generation)."""
        return max(self.training_bytes, self.sync_bytes, self.generation_bytes)

    @property
    def fits(self) -> bool | None:
        return None if self.gpu_memory_bytes is None else self.total_bytes <= self.gpu_memory_bytes

    def as_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "components_bytes": dict(self.components),
            "training_bytes": self.training_bytes,
            "sync_bytes": self.sync_bytes,
            "sync_transient_bytes": self.sync_transient_bytes,
            "generation_bytes": self.generation_bytes,
            "total_bytes": self.total_bytes,
            "gpu_memory_bytes": self.gpu_memory_bytes,
            "fits": self.fits,
            "notes": list(self.notes),
        }


def _padded_vocab(vocab: int, tp: int, divisible_by: int) -> int:
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def stage_parameters(
    arch: Architecture, *, tp: int, pp: int, stage: int, divisible_by: int = 128, ep: int = 1, etp: int | None = None
) -> int:
    """Parameters held by one rank of pipeline stage ``stage`` (TP shards; norms replicated;
    a mixture of experts' router replicated, its experts split over ``ep`` ranks and each
    expert over ``etp``, TP when None)."""
    h, f, d = arch.hidden_size, arch.ffn_hidden_size, arch.head_dim
    q, kv = arch.num_attention_heads * d, arch.num_query_groups * d
    per_layer = (h * (q + 2 * kv) + (q + 2 * kv if arch.qkv_bias else 0) + q * h) // tp
    per_layer += 2 * h + (2 * d if arch.qk_norm else 0)
    layers = arch.num_layers // pp
    if arch.is_moe:
        per_layer += arch.num_experts * h
    else:
        per_layer += 3 * h * f // tp
    vocab_rows = _padded_vocab(arch.vocab_size, tp, divisible_by) // tp
    params = layers * per_layer + stage_expert_parameters(arch, etp=etp or tp, pp=pp, ep=ep)
    if stage == 0:
        params += vocab_rows * h
    if stage == pp - 1:
        params += h  # final norm
        if not arch.tie_word_embeddings or pp > 1:
            params += vocab_rows * h  # output layer (a tied model's last stage keeps its own copy)
    return params


def lora_parameters(arch: Architecture, lora: LoRAConfig, *, tp: int, pp: int) -> int:
    """The LoRA adapters' parameters on one rank of a pipeline stage (``models.lora``): a
    column-parallel linear ``[in -> out]`` holds A ``[r, in]`` whole and its ``out / TP``
    rows of B, a row-parallel one its ``in / TP`` columns of A and B ``[out, r]`` whole."""
    h, r = arch.hidden_size, lora.rank
    qkv, q = (arch.num_attention_heads + 2 * arch.num_query_groups) * arch.head_dim, arch.num_attention_heads * arch.head_dim
    per_target = {
        "linear_qkv": r * h + qkv // tp * r,  # column-parallel
        "linear_proj": r * (q // tp) + h * r,  # row-parallel
        "linear_fc1": r * h + 2 * arch.ffn_hidden_size // tp * r,  # column-parallel, [gate; up]
        "linear_fc2": r * (arch.ffn_hidden_size // tp) + h * r,  # row-parallel
    }
    return arch.num_layers // pp * sum(per_target[name] for name in lora.target_modules)


def stage_expert_parameters(arch: Architecture, *, etp: int, pp: int, ep: int) -> int:
    """The routed experts' parameters on one rank (``E / ep`` experts of each of its
    stage's layers, each SwiGLU ``3 H F_e`` split over expert TP); 0 for a dense model."""
    if not arch.is_moe:
        return 0
    return (arch.num_layers // pp) * (arch.num_experts // ep) * 3 * arch.hidden_size * arch.moe_ffn_hidden_size // etp


def activation_bytes_per_token_layer(
    arch: Architecture, *, tp: int, sequence_parallel: bool, seq_len: int, flash: bool, recompute: str, a: int
) -> float:
    """Bytes one token leaves saved in one layer for the backward pass (module docstring)."""
    h, f, d = arch.hidden_size, arch.ffn_hidden_size, arch.head_dim
    q_heads, kv_heads = arch.num_attention_heads, arch.num_query_groups
    t_sp = tp if sequence_parallel else 1
    if recompute == "full":
        return a * h / t_sp
    mlp = moe_bytes_per_token(arch, tp=tp, t_sp=t_sp) if arch.is_moe else 5 * f / tp
    sharded = (4 * q_heads * d + 3 * kv_heads * d + q_heads) / tp + mlp
    unfused = arch.attention_dropout > 0 and not flash and recompute != "selective"
    attention = q_heads * seq_len / tp if unfused else 0.0
    return a * (5 * h / t_sp + sharded + 2 * d + 2 + attention)


def moe_bytes_per_token(arch: Architecture, *, tp: int, t_sp: int) -> float:
    """Elements a mixture-of-experts MLP saves per token (times the activation bytes), in
    place of a dense MLP's ``5F / t``:

        k (6 F_e / t + H / t_sp) + 5H / (2 t_sp) + 2E / t_sp

    each of the token's k expert copies saves a dense SwiGLU's five expert-width tensors
    plus its routing weight times the activation (megatron's ``SequentialMLP`` scales
    before ``linear_fc2``), and its permuted input; the rest (the dispatcher's copies of
    the layer's tokens, the router's logits and probabilities) is per token. Fitted to
    three layers measured like the dense ones (``benchmarks/saved_activations.py``, TP 1:
    within 3% of each); the TP and sequence-parallel divisions follow megatron's
    splitting and are not measured."""
    k, h, f_e, e = arch.moe_topk, arch.hidden_size, arch.moe_ffn_hidden_size, arch.num_experts
    return k * (6 * f_e / tp + h / t_sp) + 5 * h / (2 * t_sp) + 2 * e / t_sp


def plan_memory(
    arch: Architecture,
    *,
    parallel: ParallelConfig,
    model: ModelOptions,
    trainer: TrainerConfig,
    actor: ActorConfig,
    rollout: RolloutConfig,
    with_reference: bool,
    use_te: bool,
    gpu_memory_bytes: int | None = None,
) -> MemoryPlan:
    """The per-GPU memory plan of the run's actor (the worst pipeline stage)."""
    tp, pp, dp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size, parallel.resolved_data_parallel_size
    ep, etp = parallel.expert_model_parallel_size, parallel.resolved_expert_tensor_parallel_size
    a = 2 if model.dtype == "bfloat16" else 4
    seq_len = min(rollout.max_sequence_tokens, trainer.max_tokens_per_microbatch)
    per_rank = -(-rollout.num_samples_per_step // (trainer.num_minibatches_per_step * dp))  # sequences per mini-batch
    seqs_per_microbatch = max(1, min(trainer.max_tokens_per_microbatch // seq_len, per_rank))
    microbatches = -(-per_rank // seqs_per_microbatch)
    tokens = seqs_per_microbatch * seq_len  # the worst micro-batch: full-length sequences
    vocab_rows = _padded_vocab(arch.vocab_size, tp, model.make_vocab_size_divisible_by) // tp
    flash = use_te
    best: MemoryPlan | None = None
    generation = 0
    # With LoRA only the adapters train (the frozen base has no gradient, no optimizer state);
    # every stage holds the same number of layers, so the same adapters.
    adapters = 0 if actor.lora is None else lora_parameters(arch, actor.lora, tp=tp, pp=pp)
    for stage in range(pp):
        params = stage_parameters(arch, tp=tp, pp=pp, stage=stage, divisible_by=model.make_vocab_size_divisible_by,
                                  ep=ep, etp=etp)  # fmt: skip
        experts = stage_expert_parameters(arch, etp=etp, pp=pp, ep=ep)
        plan = MemoryPlan(gpu_memory_bytes=gpu_memory_bytes, stage=stage)
        c = plan.components
        trained, trained_experts = (params, experts) if actor.lora is None else (adapters, 0)
        c["parameters"] = (params + adapters) * a
        c["gradients"] = trained * 4  # megatron DDP reduces gradients in a float32 buffer
        optimizer_per_param = 8 + (4 if a == 2 else 0)  # Adam moments (+ float32 master weights)
        # The distributed optimizer shards the dense parameters' state over DP and the
        # experts' over the expert-data-parallel group (the ranks holding the same expert
        # shards: world / (ETP * EP * PP) = DP * TP / (ETP * EP)).
        shards = dp if actor.use_distributed_optimizer else 1
        expert_shards = max(1, dp * tp // (etp * ep)) if actor.use_distributed_optimizer else 1
        dense = trained - trained_experts
        c["optimizer_state"] = dense * optimizer_per_param // shards + trained_experts * optimizer_per_param // expert_shards
        # torch's AdamW as a loop or foreach kernels (actor.optimizer_kernel) works through
        # float32 temporaries as large as the parameters it updates (with the distributed
        # optimizer, its shard); the fused kernels (torch's, TE's, Apex's) update in place.
        fused_adam = actor.optimizer_kernel in ("auto", "fused")
        c["optimizer_step_temporaries"] = 0 if fused_adam else dense * 4 // shards + trained_experts * 4 // expert_shards
        layers = arch.num_layers // pp
        per_token = activation_bytes_per_token_layer(
            arch, tp=tp, sequence_parallel=parallel.sequence_parallel, seq_len=seq_len, flash=flash,
            recompute=actor.recompute_granularity, a=a,
        )  # fmt: skip
        in_flight = min(pp - stage, microbatches)  # 1F1B warm-up: stage i holds pp - i micro-batches
        activations = per_token * tokens * layers * in_flight
        if actor.recompute_granularity == "full":  # one recompute unit's full activations at a time
            unit = layers if actor.recompute_method == "block" else min(actor.recompute_num_layers, layers)
            full = activation_bytes_per_token_layer(
                arch, tp=tp, sequence_parallel=parallel.sequence_parallel, seq_len=seq_len, flash=flash,
                recompute="none", a=a,
            )  # fmt: skip
            activations += full * tokens * unit
        c["activations"] = int(activations)
        if stage == pp - 1:
            if actor.logits_chunk_tokens is not None:
                chunk = actor.logits_chunk_tokens * vocab_rows * 4
            else:
                budget = chunk_budget_bytes("cuda" if use_te else "cpu", linear=actor.loss_impl == "fused_linear")
                chunk = min(budget, tokens * vocab_rows * 4)
            # The Triton kernels (CUDA, loss_kernel auto/triton) keep no float32 workspace: a
            # chunk's logits in their own dtype, overwritten by their gradient (fused lm-head),
            # or nothing beyond the gradient (materialised logits).
            triton = use_te and actor.loss_kernel != "torch"
            if actor.loss_impl == "fused_linear":
                # gathered hidden states, their float32 gradient, and a chunk's logits (+ softmax and gradient)
                per_chunk = chunk * a // 4 if triton else 3 * chunk
                c["loss_buffers"] = tokens * arch.hidden_size * (a + 4) + per_chunk
            else:
                # the logits and their gradient (logits dtype), the copy megatron's output layer
                # makes of that gradient in its backward (it arrives transposed, [b, s] ->
                # [s, b], and the weight-gradient GEMM wants it contiguous), and the chunk workspace
                c["loss_buffers"] = 3 * tokens * vocab_rows * a + (0 if triton else 2 * chunk)
        else:
            c["loss_buffers"] = 0
        resident_ref = with_reference and not actor.reference_offload
        # The backward pass materialises each weight's gradient (parameter dtype) before
        # megatron's DDP hook adds it into the float32 buffer; the largest, the embedding or
        # output layer (V/TP x H), bounds what is live at once.
        largest = vocab_rows * arch.hidden_size if stage in (0, pp - 1) else (
            arch.hidden_size * max(_mlp_fc1_rows(arch), (arch.num_attention_heads + 2 * arch.num_query_groups)
                                   * arch.head_dim) // tp)  # fmt: skip
        if actor.lora is not None:
            # Frozen weights get no gradient (the adapters' are r x in or out x r), so the
            # backward's largest transient is the MLP's: the gradient of fc1's output and the
            # SwiGLU's of the same width, plus that of its input (measured on CPU:
            # tests/distributed/test_planner.py's LoRA case; hidden, under full-parameter
            # training, by the output layer's weight gradient).
            adapter_grad = actor.lora.rank * max(arch.hidden_size, _mlp_fc1_rows(arch), arch.num_attention_heads * arch.head_dim)
            activation_grads = tokens * (2 * _mlp_fc1_rows(arch) // tp + arch.hidden_size)
            largest = max(adapter_grad, activation_grads)
        c["backward_temporaries"] = largest * a
        # With LoRA the reference is the actor with its adapters off: no copy.
        c["reference_policy"] = params * a if resident_ref and actor.lora is None else 0
        engines = _colocated_engine_bytes(rollout, gpu_memory_bytes, use_cuda=use_te or gpu_memory_bytes is not None)
        if rollout.placement == "colocated" and rollout.engine == "hf" and str(rollout.engine_args.get("device", "")).startswith("cuda"):
            engines += _engine_weight_bytes(arch, model, rollout)  # the built-in engine holds the whole model
        if rollout.placement == "colocated":  # the trainer offloads all but the weights while engines generate
            plan.generation_bytes = c["parameters"] + engines
        else:
            plan.generation_bytes = c["parameters"] + c["gradients"] + c["optimizer_state"] + c["reference_policy"]
        generation = max(generation, plan.generation_bytes)
        if stage == 0:  # global rank 0 sends every sync
            transient = sync_transient_bytes(arch, parallel=parallel, model=model, rollout=rollout, use_cuda=use_te)
            if rollout.placement == "colocated" and engines:
                # the engine on this GPU wakes its weights (its TP shard), not its KV cache
                resident = c["parameters"] + _engine_weight_bytes(arch, model, rollout)
            else:
                resident = plan.generation_bytes
            sync = (resident + transient, transient)
        if best is None or plan.training_bytes > best.training_bytes:
            best = plan
    assert best is not None
    best.generation_bytes = generation  # the stage whose resident state is largest
    best.sync_bytes, best.sync_transient_bytes = sync
    best.notes.append(
        "activations assume " + ("Transformer Engine's fused attention" if flash else (
            "megatron's unfused attention (attention dropout)" if arch.attention_dropout > 0 else
            "the local spec's scaled_dot_product_attention"))
        + f"; {microbatches} micro-batch(es) of {tokens} tokens per step and DP rank"
    )  # fmt: skip
    if arch.is_moe:
        total, active = arch.parameters()
        best.notes.append(
            f"mixture of experts: {total / 1e9:.2f}B parameters, {active / 1e9:.2f}B active per token "
            f"({arch.moe_topk} of {arch.num_experts} experts); expert activations per token: "
            "fitted on CPU at TP 1 (moe_bytes_per_token), not measured on a GPU"
        )
    if actor.lora is not None:
        best.notes.append(
            f"LoRA rank {actor.lora.rank} on {', '.join(actor.lora.target_modules)}: {adapters / 1e6:.2f}M trainable "
            "parameters per rank (the gradients and optimizer state); the base model is frozen, and a reference "
            "policy is the actor with its adapters off (no copy)"
        )
    if rollout.placement == "colocated":
        best.notes.append("generation: the actor keeps only its weights on the GPU (gradients, optimizer state and "
                          "reference offloaded) while the engines hold their share")  # fmt: skip
    return best


def _mlp_fc1_rows(arch: Architecture) -> int:
    """Rows of the largest MLP projection: the dense ``[gate; up]`` (2F), or one expert's (2 F_e)."""
    return 2 * (arch.moe_ffn_hidden_size if arch.is_moe else arch.ffn_hidden_size)


def _dtype_bytes(name: str) -> int:
    return {"bfloat16": 2, "float16": 2, "float32": 4}.get(str(name).removeprefix("torch."), 2)


def _engine_weight_bytes(arch: Architecture, model: ModelOptions, rollout: RolloutConfig) -> int:
    """One engine worker's weights (its TP shard of the HF model, in the engines' dtype)."""
    engine_dtype = _dtype_bytes(rollout.engine_args.get("dtype", model.dtype))
    total = stage_parameters(arch, tp=1, pp=1, stage=0, divisible_by=1)
    return total * engine_dtype // rollout.tensor_parallel_size


def sync_transient_bytes(
    arch: Architecture, *, parallel: ParallelConfig, model: ModelOptions, rollout: RolloutConfig, use_cuda: bool
) -> int:
    """What one weight sync adds on the sending rank (global rank 0), in bytes.

    The sync streams one weight unit at a time (``actor.weights``: the largest is the
    embedding or output layer, else a layer's fused QKV or ``[gate; up]`` projection):
    the TP gather holds the shards and their concatenation (2x the unit; 1x without TP),
    the HF split copies it once more, and the cast to the engines' dtype adds the unit in
    that dtype. The sender's buffers come on top, each at least the largest tensor (a
    tensor is never split): vLLM's ``nccl`` two packed buffers of the bucket size
    (``rollout.weight_sync_bucket_mb``), ``ipc`` one; the host transports (object store,
    shared memory, gloo) none on a GPU (their chunks are host memory), and on CPU, where
    host memory is the device, a packed chunk plus the chunk's tensors waiting for it.
    """
    a = _dtype_bytes(model.dtype)
    e = _dtype_bytes(rollout.engine_args.get("dtype", model.dtype))
    h, vocab = arch.hidden_size, _padded_vocab(arch.vocab_size, 1, 1)
    layer_unit = h * max(_mlp_fc1_rows(arch), arch.num_experts, (arch.num_attention_heads + 2 * arch.num_query_groups)
                         * arch.head_dim)  # fmt: skip
    unit = max(vocab * h, layer_unit)
    tp = parallel.tensor_model_parallel_size
    transient = unit * a * (2 if tp > 1 else 1) + unit * a + (unit * e if e != a else 0)
    bucket = rollout.weight_sync_bucket_mb << 20
    buffer = max(bucket, max(vocab, _mlp_fc1_rows(arch) // 2) * h * e)
    transport = rollout.weight_transport
    if transport == "auto":
        transport = ("cuda_ipc" if rollout.placement == "colocated" and rollout.engine == "vllm" else "collective") if (
            use_cuda) else "shared_memory"  # fmt: skip
    if not use_cuda:
        return transient + buffer + bucket
    if transport == "collective":
        return transient + (2 * buffer if rollout.engine == "vllm" else 0)
    if transport == "cuda_ipc":
        return transient + buffer
    return transient


def _colocated_engine_bytes(rollout: RolloutConfig, gpu_memory_bytes: int | None, *, use_cuda: bool) -> int:
    """The colocated engines' share of one GPU during generation (vLLM's memory fraction)."""
    if rollout.placement != "colocated" or rollout.engine != "vllm" or gpu_memory_bytes is None or not use_cuda:
        return 0
    return int(float(rollout.engine_args.get("gpu_memory_utilization", 0.9)) * gpu_memory_bytes)
