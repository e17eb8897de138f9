"""The ``trainer`` section (the loop, the update schedule and the optimizer) and the
``actor`` section (Megatron-actor settings)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from megatron_rl.config.lib import (
    MAX_SEED,
    MAX_TIMEOUT_S,
    ConfigError,
    check_literals,
    require_range,
    warn_config,
)
from megatron_rl.config.model import require_positive_ints


@dataclass(kw_only=True)
class OptimConfig:
    """The optimizer and its learning-rate schedule (Adam, megatron-core's optimizer).

    Declared once here; the ``trainer`` section extends this class (so the YAML keys are
    ``trainer.lr``, ``trainer.weight_decay``, ...) and the actor receives it whole,
    mapped to megatron's ``OptimizerConfig`` in one function (``actor/optimizer.py``).
    """

    lr: float = 1e-6
    """Peak learning rate of Adam."""

    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    """Decay after warm-up: ``constant``, or ``cosine``/``linear`` down to ``min_lr`` at the
    run's last optimizer step."""

    lr_warmup_steps: int = 0
    """Optimizer steps of linear warm-up from 0 to ``lr``."""

    min_lr: float = 0.0
    """Final learning rate of the ``cosine`` and ``linear`` schedules."""

    weight_decay: float = 0.01
    """Decoupled (AdamW) weight decay."""

    adam_beta1: float = 0.9
    """Adam's first-moment decay."""

    adam_beta2: float = 0.999
    """Adam's second-moment decay."""

    adam_eps: float = 1e-8
    """Adam's denominator epsilon."""

    grad_clip: float | None = 1.0
    """Clip the global gradient norm to this value; null disables clipping."""

    def __post_init__(self) -> None:
        check_literals(self)
        require_range("lr", self.lr, gt=0.0)
        require_range("lr_warmup_steps", self.lr_warmup_steps, ge=0)
        require_range("min_lr", self.min_lr, ge=0.0, le=self.lr)
        require_range("weight_decay", self.weight_decay, ge=0.0)
        require_range("adam_beta1", self.adam_beta1, ge=0.0, lt=1.0)
        require_range("adam_beta2", self.adam_beta2, ge=0.0, lt=1.0)
        require_range("adam_eps", self.adam_eps, gt=0.0)
        require_range("grad_clip", self.grad_clip, gt=0.0)
        if self.lr_schedule == "constant" and self.min_lr != 0.0:
            warn_config("min_lr", f"{self.min_lr!r} is ignored because lr_schedule is 'constant'")


@dataclass(kw_only=True)
class TrainerConfig(OptimConfig):
    """The optimisation loop: steps, the update schedule, the optimizer, checkpoints."""

    num_steps: int = 20
    """RL steps (rollout + update) to run."""

    num_minibatches_per_step: int = 1
    """Optimizer updates per RL step and update pass: the step's responses are split into
    this many mini-batches (must divide ``num_prompts_per_step * num_samples_per_prompt``)."""

    num_epochs_per_step: int = 1
    """Passes over the step's responses (each pass makes ``num_minibatches_per_step`` updates)."""

    max_tokens_per_microbatch: int = 4096
    """Token budget of one forward/backward micro-batch; a mini-batch's gradient is
    accumulated over its micro-batches. Packed: real tokens (plus the alignment padding
    of the pack's end); padded: rows x the longest row."""

    pack_sequences: bool | Literal["auto"] = "auto"
    """Lay whole sequences end to end in each micro-batch (no padding; attention within a
    sequence, RoPE positions restarting at each) for the actor's and the reference
    policy's forward/backward and log-prob passes; false pads every row to the
    micro-batch's longest (results agree within float rounding). ``auto`` packs with
    Transformer Engine (its variable-length attention makes packing free), and otherwise
    when padding would be more than ``actor.batch.AUTO_PACK_PADDING_FRACTION`` (0.2) of
    the padded micro-batches' tokens, decided per pass from its sequence lengths: the
    local spec's packed attention costs more per token, which only removing that much
    padding repays (``docs/benchmarks.md``)."""

    seed: int = 1234
    """Seed of model init, data order and sampling, in [0, 2**63 - 1]."""

    save_every_steps: int = 0
    """Write a checkpoint every this many steps; 0: none during the run (see ``save_final``)."""

    save_final: bool = True
    """Also write a checkpoint after the last step (so the run can be resumed, extended or
    converted); false skips it (benchmarks, throwaway runs)."""

    keep_last_checkpoints: int = 0
    """Keep only this many newest checkpoints of the run (older ones are deleted after each
    save; the one ``latest`` names is never deleted); 0 keeps all."""

    keep_every_steps: int = 0
    """With ``keep_last_checkpoints``: also keep every checkpoint whose step is a multiple of
    this (a multiple of ``save_every_steps``); 0: none beyond the newest."""

    eval_every_steps: int = 0
    """Evaluate on ``data.eval_files`` every this many steps; 0 disables evaluation."""

    eval_before_train: bool = False
    """Also evaluate before the first step of a run that starts fresh, logged as step 0 (the
    starting point's accuracy, e.g. an SFT checkpoint's); a resumed run does not repeat it.
    Needs ``eval_every_steps``."""

    max_consecutive_nonfinite_steps: int = 3
    """A step whose loss or gradient norm is not finite is skipped; this many in a row stop
    the run (the last good checkpoint is kept)."""

    max_consecutive_reward_error_steps: int = 3
    """A step in which the reward raised (or timed out) on EVERY response gives no learning
    signal; this many such steps in a row stop the run (exit code 1) instead of training
    on all-zero advantages."""

    resume: str = "auto"
    """``auto``: continue from the run directory's latest checkpoint if there is one;
    ``never``: start fresh; any other value is the path of a checkpoint to resume from."""

    resume_optimizer_schedule: Literal["config", "checkpoint"] = "config"
    """On resume, whose optimizer settings hold (``lr``, ``min_lr``, ``lr_warmup_steps``,
    ``lr_schedule``, ``weight_decay``, Adam's betas and eps, the decay length): ``config``
    requires the checkpoint's to equal this config's, and a difference is an error naming
    the field (megatron's scheduler would silently keep the checkpoint's); ``checkpoint``
    continues with the checkpoint's, written into the run's saved config with a warning."""

    output_dir: str = "runs"
    """Parent directory of run directories; a run writes to ``output_dir/logging.run_name``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require_positive_ints(
            self, "num_steps", "num_minibatches_per_step", "num_epochs_per_step", "max_tokens_per_microbatch",
            "max_consecutive_nonfinite_steps",
        )  # fmt: skip
        require_range("save_every_steps", self.save_every_steps, ge=0)
        require_range("eval_every_steps", self.eval_every_steps, ge=0)
        if self.eval_before_train and not self.eval_every_steps:
            raise ConfigError("eval_before_train", "needs evaluation on: set eval_every_steps")
        require_range("keep_last_checkpoints", self.keep_last_checkpoints, ge=0)
        require_range("keep_every_steps", self.keep_every_steps, ge=0)
        if self.keep_every_steps and not self.keep_last_checkpoints:
            raise ConfigError("keep_every_steps", f"{self.keep_every_steps}: every checkpoint is kept already "
                              "(keep_last_checkpoints: 0); set keep_last_checkpoints to prune the others")  # fmt: skip
        if self.keep_every_steps and (not self.save_every_steps or self.keep_every_steps % self.save_every_steps):
            raise ConfigError("keep_every_steps", f"{self.keep_every_steps} is not a multiple of save_every_steps "
                              f"({self.save_every_steps}): no checkpoint would be written at those steps")  # fmt: skip
        require_range("seed", self.seed, ge=0, le=MAX_SEED)
        require_positive_ints(self, "max_consecutive_reward_error_steps")
        for name, least, most in (("num_steps", 1, 1 << 31), ("lr_warmup_steps", 0, 1 << 31),
                                  ("num_minibatches_per_step", 1, 1 << 16), ("num_epochs_per_step", 1, 1024),
                                  ("max_tokens_per_microbatch", 1, 1 << 24)):  # fmt: skip
            require_range(name, getattr(self, name), ge=least, le=most)
        if not self.resume.strip():
            raise ConfigError("resume", "got ''; use 'auto', 'never' or a checkpoint path")
        if not self.output_dir.strip():
            raise ConfigError("output_dir", "got ''; must be a directory path")
        if self.lr_warmup_steps > self.num_steps:
            warn_config("lr_warmup_steps", f"{self.lr_warmup_steps} exceeds num_steps ({self.num_steps})")

    @property
    def resume_path(self) -> Path | None:
        """The explicit checkpoint to resume from, or ``None`` for ``auto``/``never``."""
        return None if self.resume in ("auto", "never") else Path(self.resume)


LoRATarget = Literal["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
"""A linear layer of the decoder an adapter can sit on, by megatron-core's name: attention's
fused QKV and output projections, the MLP's fused gate/up and down projections
(``models.lora.TARGET_MODULES``)."""


@dataclass(kw_only=True)
class LoRAConfig:
    """Low-rank adapters on the actor's linear layers (``docs/lora.md``): each targeted
    layer computes ``W x + (alpha / rank) B A dropout(x)`` with its weight W frozen and only
    A ``[rank, in]`` and B ``[out, rank]`` trained (B starts at zero, so the run starts at
    the base model). Everything else is frozen too (embedding, norms, output layer): the
    optimizer state and gradients exist for the adapters only, and a reference policy (a
    KL term) is the same model with the adapters switched off, with no copy of the weights."""

    rank: int = 16
    """r, the adapters' inner width."""

    alpha: float = 32.0
    """The adapters' update is scaled by ``alpha / rank``."""

    dropout: float = 0.0
    """Dropout on the adapters' input in training forwards (log-prob passes use none)."""

    target_modules: list[LoRATarget] = field(default_factory=lambda: list(LoRATarget.__args__))
    """Which linear layers of every decoder layer carry an adapter (megatron's names:
    ``linear_qkv`` = q/k/v_proj, ``linear_proj`` = o_proj, ``linear_fc1`` = gate/up_proj,
    ``linear_fc2`` = down_proj). A mixture-of-experts model's experts take none: target
    attention only there."""

    def __post_init__(self) -> None:
        require_range("rank", self.rank, ge=1, le=1 << 16)
        require_range("alpha", self.alpha, gt=0.0)
        require_range("dropout", self.dropout, ge=0.0, lt=1.0)
        allowed = LoRATarget.__args__
        if not self.target_modules or len(set(self.target_modules)) != len(self.target_modules) \
                or not set(self.target_modules) <= set(allowed):  # fmt: skip
            raise ConfigError(
                "target_modules", f"got {self.target_modules}; a non-empty list of distinct names from {list(allowed)}"
            )


@dataclass(kw_only=True)
class ActorConfig:
    """Settings of the Megatron actor that are neither architecture nor optimizer: optimizer
    sharding, checkpoint format, the loss path, activation recompute, the reference policy."""

    use_distributed_optimizer: bool = True
    """Shard the optimizer state over the data-parallel ranks (megatron's
    DistributedOptimizer); false: megatron's plain optimizer, its state replicated on every
    DP rank (at one DP rank it saves the distributed optimizer's collectives over that one
    rank: the optimizer step 7.8 -> 5.0 ms on the vs-TRL benchmark's model, about 2 % of
    its RL step, docs/benchmarks.md). A checkpoint's optimizer state loads only into the
    kind of optimizer that wrote it (into the other: weights, schedule and counters, with a
    warning)."""

    optimizer_kernel: Literal["auto", "fused", "foreach", "for_loop"] = "auto"
    """torch's AdamW implementation, used when megatron-core falls back to torch's optimizer
    (neither Transformer Engine nor Apex installed; with either, megatron uses their fused
    Adam, and any value but ``auto`` is a ``ConfigError``): ``fused`` one kernel over all
    parameters, no temporaries (CPU and CUDA; the optimizer step 8.5 -> 5.2 ms on the
    vs-TRL benchmark's model, docs/benchmarks.md); ``foreach`` list kernels with
    parameter-sized temporaries (torch's own default on CUDA); ``for_loop`` one parameter
    at a time (torch's default on CPU); ``auto`` is ``fused``. The choice holds after a
    checkpoint is loaded."""

    checkpoint_optimizer_sharding: Literal["dp_reshardable", "fully_reshardable"] = "dp_reshardable"
    """Optimizer-state format of saved checkpoints: ``dp_reshardable`` (no gathering;
    restores at another DP size, and at another TP/PP restarts Adam with a warning) or
    ``fully_reshardable`` (gathered per parameter; loads at any TP/PP/DP)."""

    logits_chunk_tokens: int | None = None
    """Tokens per chunk of the fused loss; null sizes chunks by the device's budget of
    float32 logits (``ops.vocab_parallel.chunk_budget_bytes``: 4 MiB on CPU, 256 MiB on
    CUDA; 64 MiB / 1 GiB with the fused lm-head). On materialised logits (``loss_impl:
    logits``) the Triton kernels (``loss_kernel``) take all tokens in one launch unless
    this is set."""

    loss_kernel: Literal["auto", "torch", "triton"] = "auto"
    """The fused loss's passes over the logits (``ops.vocab_parallel.resolve_kernel``):
    ``triton`` reads the logits once per pass (``ops.triton_kernels``; CUDA only: a
    ``ConfigError`` when the actor starts elsewhere, or with float64 weights), ``torch`` runs chunked torch ops (any device; the reference the Triton
    kernels are tested against), ``auto`` picks Triton on CUDA when it imports."""

    old_logp_source: Literal["auto", "recompute"] = "auto"
    """Where the PPO ratio's old log-probs come from. ``recompute``: a forward-only pass
    over the whole batch before the update. ``auto``: the first optimizer step of an RL
    step runs the old policy's own weights, so its mini-batch takes them from its train
    forward (detached; the ratio is exactly 1) and only the other mini-batches' rows are
    recomputed first; with one mini-batch the separate pass disappears. ``auto`` falls
    back to ``recompute`` when the old log-probs are needed before that forward: Advantage
    Reweighting (``algorithm.ar``), or a pre-pass (STAPO) together with truncated importance
    sampling (``rollout.tis_cap``; without a pre-pass the loss applies that step's TIS
    weights from its own forward)."""

    loss_impl: Literal["fused_linear", "logits"] = "fused_linear"
    """How the last pipeline stage feeds the fused loss: ``fused_linear`` takes the final
    hidden states and this rank's output-layer shard and multiplies chunk by chunk, so the
    ``[tokens, vocab/TP]`` logits never exist (training, old/reference log-probs and the
    diagnostics alike); ``logits`` materialises them with megatron's output layer first."""

    recompute_granularity: Literal["none", "selective", "full"] = "none"
    """Activation recompute (megatron-core's options): ``selective`` recomputes the core
    attention, ``full`` whole layers (see ``recompute_method``); ``none`` keeps activations."""

    recompute_method: Literal["uniform", "block"] = "uniform"
    """With ``full`` recompute: ``uniform`` recomputes every layer in units of
    ``recompute_num_layers``; ``block`` recomputes the first ``recompute_num_layers`` layers
    of each pipeline stage."""

    recompute_num_layers: int = 1
    """Layers per recompute unit (``uniform``) or recomputed layers per stage (``block``)."""

    reference_offload: bool = False
    """Keep the reference policy's weights in host memory and bring them to the device only
    for its log-prob pass, so it holds no device memory otherwise (for large models with a
    KL term)."""

    pad_tokens_to_multiple_of: int | None = None
    """Pad each micro-batch's sequence length to a multiple of this (padding never enters
    the loss); null: what the kernels need (with FP8 the recipe's GEMM alignment: 32 for
    ``mxfp8``, 16 otherwise; 16 with Transformer Engine; the TP size with sequence
    parallelism), else 1. With FP8 a value must be a multiple of the recipe's alignment."""

    lora: LoRAConfig | None = None
    """Train low-rank adapters instead of the whole model (``LoRAConfig``); null trains
    every parameter."""

    call_timeout_s: float | None = None
    """Longest any call on the actor ranks may take (an update, a log-prob pass, a sync,
    a checkpoint) before the run stops with an error naming the ranks and the call: a rank
    that hangs (stopped, a deadlocked collective, a stalled file system) must not hang the
    run silently. null: 1800 s plus the time to write the largest rank's share of a
    checkpoint (16 bytes per parameter) at 50 MiB/s (``actor.group.default_call_timeout_s``);
    at most a day."""

    def __post_init__(self) -> None:
        check_literals(self)
        require_range("call_timeout_s", self.call_timeout_s, gt=0.0, le=MAX_TIMEOUT_S)
        if not self.use_distributed_optimizer and self.checkpoint_optimizer_sharding == "fully_reshardable":
            raise ConfigError(
                "use_distributed_optimizer",
                "false, but checkpoint_optimizer_sharding 'fully_reshardable' is a format of the distributed "
                "optimizer; set it true, or checkpoint_optimizer_sharding 'dp_reshardable'",
            )
        require_range("logits_chunk_tokens", self.logits_chunk_tokens, ge=1, le=1 << 24)
        require_range("recompute_num_layers", self.recompute_num_layers, ge=1)
        require_range("pad_tokens_to_multiple_of", self.pad_tokens_to_multiple_of, ge=1)
