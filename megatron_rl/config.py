"""The typed run config: one keyword-only dataclass per YAML section.

A run is described by ``RunConfig`` (``model``, ``parallel``, ``rollout``, ``algorithm``,
``trainer``, ``data``, ``logging``). Read one with :func:`load_run_config` (YAML plus
dotted ``section.field=value`` overrides); the generic machinery (type checks, "did you
mean" errors, saving the resolved config) lives in :mod:`megatron_rl.configlib`.

Conventions (``docs/style.md``): a docstring under every field (``docs/config.md`` is
generated from them), units and scope in names, checks of one section in its
``__post_init__`` with the path relative to the section, checks that span sections in
``RunConfig.__post_init__`` with the full path, and a :class:`ConfigWarning` rather than
an error when a setting is legal but ignored. Engine settings are not re-declared:
``rollout.engine_args`` is handed to the engine unchanged.

``python -m megatron_rl.config`` prints the field reference (``docs/config.md``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from megatron_rl.algo.config import AlgorithmConfig
from megatron_rl.configlib import (
    ConfigError,
    check_literals,
    load_config,
    render_docs,
    require_range,
    warn_config,
)


def _require_positive_ints(obj: Any, *names: str) -> None:
    """Raise unless each named int field of ``obj`` is >= 1."""
    for name in names:
        require_range(name, getattr(obj, name), ge=1)


# --------------------------------------------------------------------------- model


@dataclass(kw_only=True)
class TinyModelConfig:
    """An inline Hugging Face-style architecture for small CPU runs (random init, no files).

    Field names follow the HF ``config.json`` keys (``num_layers`` is HF's
    ``num_hidden_layers``); ``to_hf_config_dict()`` gives the equivalent ``config.json``, so
    the same builder serves it and a real checkpoint's config.
    """

    model_type: Literal["qwen2", "qwen3", "llama"] = "qwen2"
    """HF ``model_type``; picks the ``models/<arch>/`` spec and weight adapter."""

    hidden_size: int = 64
    """Width of the residual stream."""

    num_layers: int = 2
    """Number of transformer layers (HF ``num_hidden_layers``)."""

    num_attention_heads: int = 4
    """Query heads; must divide ``hidden_size``."""

    num_key_value_heads: int = 2
    """Key/value heads (grouped-query attention); must divide ``num_attention_heads``."""

    intermediate_size: int = 128
    """Hidden width of the MLP (SwiGLU)."""

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

    def __post_init__(self) -> None:
        check_literals(self)
        _require_positive_ints(
            self, "hidden_size", "num_layers", "num_attention_heads", "num_key_value_heads",
            "intermediate_size", "vocab_size", "max_position_embeddings",
        )  # fmt: skip
        require_range("rope_theta", self.rope_theta, gt=0.0)
        require_range("rms_norm_eps", self.rms_norm_eps, gt=0.0)
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
        """The equivalent HF ``config.json`` content (keys as ``transformers`` names them)."""
        return {
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
class ModelConfig:
    """The policy model: its architecture (a HF config or the inline ``tiny`` one) and weights.

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
    checkpoint (see ``megatron-rl convert``). Read only with ``init: pretrained``."""

    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter and compute dtype of the actor (optimizer state stays float32)."""

    def __post_init__(self) -> None:
        check_literals(self)
        if (self.hf_config is None) == (self.tiny is None):
            state = "both are set" if self.tiny is not None else "neither is set"
            raise ConfigError("hf_config", f"set exactly one of model.hf_config and model.tiny; {state}")
        if self.init == "pretrained" and self.checkpoint is None and self.hf_config is None:
            raise ConfigError(
                "checkpoint", "got None; init 'pretrained' with a tiny model needs a checkpoint to load"
            )
        if self.init == "random" and self.checkpoint is not None:
            warn_config("checkpoint", f"{self.checkpoint!r} is ignored because init is 'random'")


# --------------------------------------------------------------------------- parallel


@dataclass(kw_only=True)
class ParallelConfig:
    """How the actor (trainer) model is split over its ranks (Megatron parallel sizes)."""

    num_actor_ranks: int = 1
    """Processes (GPUs, or CPU ranks) that train the actor."""

    tensor_model_parallel_size: int = 1
    """Tensor-parallel (TP) size: each layer's weights are split over this many ranks."""

    pipeline_model_parallel_size: int = 1
    """Pipeline-parallel (PP) size: the layers are split into this many stages."""

    context_parallel_size: int = 1
    """Context-parallel (CP) size: each sequence is split over this many ranks."""

    data_parallel_size: int | None = None
    """Data-parallel (DP) size; null derives it as ``num_actor_ranks / (TP * PP * CP)``."""

    sequence_parallel: bool = False
    """Megatron sequence parallelism (shards activations along the sequence within TP);
    needs ``tensor_model_parallel_size > 1``."""

    ray_scheduling: Literal["default", "spread"] = "default"
    """How the actor ranks and the rollout engines are placed on the Ray cluster's nodes:
    ``default`` leaves it to Ray (which tends to fill the driver's node first, so a small
    run may use one node); ``spread`` splits each group into contiguous blocks, one per
    alive node (rank ``i`` of ``k`` on node ``i * n // k``, pinned with Ray's node
    affinity), so every node gets work and neighbouring ranks share a node. The actual
    placement is written to ``RUN_DIR/placement.json`` at startup."""

    def __post_init__(self) -> None:
        check_literals(self)
        _require_positive_ints(
            self, "num_actor_ranks", "tensor_model_parallel_size", "pipeline_model_parallel_size",
            "context_parallel_size",
        )  # fmt: skip
        require_range("data_parallel_size", self.data_parallel_size, ge=1)
        model_parallel = self.model_parallel_size
        if self.num_actor_ranks % model_parallel:
            raise ConfigError(
                "num_actor_ranks",
                f"got {self.num_actor_ranks}; must be a multiple of TP * PP * CP = {model_parallel}",
            )
        if self.data_parallel_size is not None and model_parallel * self.data_parallel_size != self.num_actor_ranks:
            raise ConfigError(
                "data_parallel_size",
                f"got {self.data_parallel_size}; TP * PP * CP * DP = {model_parallel * self.data_parallel_size} "
                f"must equal num_actor_ranks ({self.num_actor_ranks})",
            )
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ConfigError("sequence_parallel", "got True; sequence parallelism needs tensor_model_parallel_size > 1")

    @property
    def model_parallel_size(self) -> int:
        """Ranks that hold one copy of the model: ``TP * PP * CP``."""
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size

    @property
    def resolved_data_parallel_size(self) -> int:
        """``data_parallel_size``, derived from ``num_actor_ranks`` when unset."""
        return self.num_actor_ranks // self.model_parallel_size


# --------------------------------------------------------------------------- rollout


@dataclass(kw_only=True)
class RolloutConfig:
    """Response generation: the engines, the batch of prompts and the sampling settings."""

    engine: Literal["hf", "vllm"] = "hf"
    """``hf``: ``transformers`` generation (CPU default); ``vllm``: vLLM engines (GPU)."""

    num_engines: int = 1
    """Rollout engine replicas (Ray actors); prompts are spread over them."""

    placement: Literal["colocated", "disaggregated"] = "colocated"
    """``colocated``: engines share the actor's devices, time-sliced (sleep/wake);
    ``disaggregated``: engines get devices of their own."""

    num_prompts_per_step: int = 8
    """Prompts drawn from the training data per RL step."""

    num_samples_per_prompt: int = 4
    """Responses sampled per prompt (the GRPO group size)."""

    temperature: float = 1.0
    """Sampling temperature (> 0); the actor scales its logits by the same value."""

    top_p: float = 1.0
    """Nucleus-sampling mass in (0, 1]; 1 disables it."""

    top_k: int = -1
    """Sample among the ``top_k`` most likely tokens; -1 disables it."""

    max_prompt_tokens: int = 128
    """Longest prompt in tokens; longer prompts are an error naming the data row."""

    max_new_tokens: int = 64
    """Most response tokens generated per sample."""

    engine_args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments handed to the engine unchanged (for ``vllm``, the ``vllm.LLM``
    engine arguments such as ``gpu_memory_utilization``); not re-declared here."""

    weight_sync_bucket_mb: int = 512
    """Size of one bucket of HF-named tensors sent from the actor to the engines, in MiB."""

    tis_cap: float | None = None
    """Truncated importance sampling: weight each token by ``min(p_actor / p_engine, tis_cap)``
    to correct the engine/actor probability mismatch; null disables it (typical: 2)."""

    def __post_init__(self) -> None:
        check_literals(self)
        _require_positive_ints(
            self, "num_engines", "num_prompts_per_step", "num_samples_per_prompt", "max_prompt_tokens",
            "max_new_tokens", "weight_sync_bucket_mb",
        )  # fmt: skip
        require_range("temperature", self.temperature, gt=0.0)
        require_range("top_p", self.top_p, gt=0.0, le=1.0)
        if self.top_k != -1 and self.top_k <= 0:
            raise ConfigError("top_k", f"got {self.top_k!r}; must be -1 (disabled) or > 0")
        require_range("tis_cap", self.tis_cap, ge=1.0)

    @property
    def num_samples_per_step(self) -> int:
        """Responses generated per RL step: ``num_prompts_per_step * num_samples_per_prompt``."""
        return self.num_prompts_per_step * self.num_samples_per_prompt

    @property
    def max_sequence_tokens(self) -> int:
        """Longest prompt + response in tokens."""
        return self.max_prompt_tokens + self.max_new_tokens


# --------------------------------------------------------------------------- trainer


@dataclass(kw_only=True)
class TrainerConfig:
    """The optimisation loop: steps, learning rate, optimizer, batching, checkpoints."""

    num_steps: int = 20
    """RL steps (rollout + update) to run."""

    lr: float = 1e-6
    """Peak learning rate of Adam."""

    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    """Decay after warm-up: ``constant``, or ``cosine``/``linear`` down to ``min_lr`` at
    ``num_steps``."""

    lr_warmup_steps: int = 0
    """Steps of linear warm-up from 0 to ``lr``."""

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

    num_minibatches_per_step: int = 1
    """Optimizer updates per RL step: the step's responses are split into this many
    mini-batches (must divide ``num_prompts_per_step * num_samples_per_prompt``)."""

    num_epochs_per_step: int = 1
    """Passes over the step's responses (each pass makes ``num_minibatches_per_step`` updates)."""

    max_tokens_per_microbatch: int = 4096
    """Token budget of one forward/backward micro-batch (responses are packed up to it);
    a mini-batch's gradient is accumulated over its micro-batches."""

    seed: int = 1234
    """Seed of model init, data order and sampling."""

    save_every_steps: int = 0
    """Write a checkpoint every this many steps (and at the end); 0 saves only at the end."""

    eval_every_steps: int = 0
    """Evaluate on ``data.eval_files`` every this many steps; 0 disables evaluation."""

    max_consecutive_nonfinite_steps: int = 3
    """A step whose loss or gradient norm is not finite is skipped; this many in a row stop
    the run (the last good checkpoint is kept)."""

    resume: str = "auto"
    """``auto``: continue from the run directory's latest checkpoint if there is one;
    ``never``: start fresh; any other value is the path of a checkpoint to resume from."""

    output_dir: str = "runs"
    """Parent directory of run directories; a run writes to ``output_dir/logging.run_name``."""

    def __post_init__(self) -> None:
        check_literals(self)
        _require_positive_ints(
            self, "num_steps", "num_minibatches_per_step", "num_epochs_per_step", "max_tokens_per_microbatch",
            "max_consecutive_nonfinite_steps",
        )  # fmt: skip
        require_range("lr", self.lr, gt=0.0)
        require_range("lr_warmup_steps", self.lr_warmup_steps, ge=0)
        require_range("min_lr", self.min_lr, ge=0.0, le=self.lr)
        require_range("weight_decay", self.weight_decay, ge=0.0)
        require_range("adam_beta1", self.adam_beta1, ge=0.0, lt=1.0)
        require_range("adam_beta2", self.adam_beta2, ge=0.0, lt=1.0)
        require_range("adam_eps", self.adam_eps, gt=0.0)
        require_range("grad_clip", self.grad_clip, gt=0.0)
        require_range("save_every_steps", self.save_every_steps, ge=0)
        require_range("eval_every_steps", self.eval_every_steps, ge=0)
        if not self.resume.strip():
            raise ConfigError("resume", "got ''; use 'auto', 'never' or a checkpoint path")
        if not self.output_dir.strip():
            raise ConfigError("output_dir", "got ''; must be a directory path")
        if self.lr_schedule == "constant" and self.min_lr != 0.0:
            warn_config("min_lr", f"{self.min_lr!r} is ignored because lr_schedule is 'constant'")
        if self.lr_warmup_steps > self.num_steps:
            warn_config("lr_warmup_steps", f"{self.lr_warmup_steps} exceeds num_steps ({self.num_steps})")

    @property
    def resume_path(self) -> Path | None:
        """The explicit checkpoint to resume from, or ``None`` for ``auto``/``never``."""
        return None if self.resume in ("auto", "never") else Path(self.resume)


# --------------------------------------------------------------------------- data


@dataclass(kw_only=True)
class DataConfig:
    """Training and evaluation prompts, how they are templated, and how answers are scored."""

    train_files: list[str] = field(default_factory=list)
    """Training prompt files (``.jsonl`` or ``.parquet``), read in order and concatenated."""

    eval_files: list[str] = field(default_factory=list)
    """Evaluation prompt files, scored every ``trainer.eval_every_steps`` steps."""

    prompt_key: str = "prompt"
    """Column (key) of a row holding the prompt text."""

    ground_truth_key: str = "ground_truth"
    """Column (key) of a row holding what the reward function compares against."""

    reward: str = "kk_logic"
    """Reward function: a registered name (``kk_logic``, ``math``, ``toy_copy``) or
    ``module:function`` for a user function; checked against the registry when the run starts."""

    reward_timeout_s: float = 10.0
    """Time limit for scoring one response; a response past it scores as a failed parse
    (and is counted in ``reward/timeouts``)."""

    num_reward_workers: int = 2
    """Worker processes that score responses (model output is parsed there, never executed)."""

    prompt_template: Literal["chat", "literal", "none"] = "chat"
    """``chat``: the prompt as a user message in the tokenizer's chat template; ``literal``:
    the reward task's own fixed template (as in the papers' code), without the tokenizer's;
    ``none``: the prompt text is tokenised as is."""

    shuffle: bool = True
    """Shuffle training prompts (seeded by ``trainer.seed``) each pass over the data."""

    def __post_init__(self) -> None:
        check_literals(self)
        require_range("reward_timeout_s", self.reward_timeout_s, gt=0.0)
        require_range("num_reward_workers", self.num_reward_workers, ge=1)
        for key in ("prompt_key", "ground_truth_key"):
            if not getattr(self, key):
                raise ConfigError(key, "got ''; must name a column")
        name = self.reward
        if ":" in name:
            module, _, func = name.partition(":")
            if not module or not func or ":" in func:
                raise ConfigError("reward", f"got {name!r}; a user reward is written 'package.module:function'")
        elif not name:
            raise ConfigError("reward", "got ''; must be a registered reward name or 'module:function'")


# --------------------------------------------------------------------------- logging


@dataclass(kw_only=True)
class LoggingConfig:
    """Run name, the metrics sink and diagnostics."""

    run_name: str = "run"
    """Name of the run; also the run directory's name under ``trainer.output_dir``."""

    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    """Weights & Biases mode: ``offline`` writes locally (sync later), ``online`` uploads,
    ``disabled`` keeps only the JSONL metrics file."""

    wandb_project: str = "megatron_rl"
    """Weights & Biases project name."""

    log_every_steps: int = 1
    """Print and record metrics every this many steps."""

    token_diagnostics: bool = False
    """Also record token-probability diagnostics (quantiles of token probabilities and of
    their gradient norms), at some extra cost per step."""

    def __post_init__(self) -> None:
        check_literals(self)
        _require_positive_ints(self, "log_every_steps")
        name = self.run_name
        if not name or name in (".", "..") or "/" in name or (os.sep in name) or "\\" in name:
            raise ConfigError("run_name", f"got {name!r}; must be a plain directory name (no path separators)")


# --------------------------------------------------------------------------- run


def _default_model() -> ModelConfig:
    # The default run is the tiny CPU one; a `model:` section in YAML starts from
    # ModelConfig's own defaults and must name hf_config or tiny itself.
    return ModelConfig(tiny=TinyModelConfig())


@dataclass(kw_only=True)
class RunConfig:
    """A whole RL run: one section per component, each documented field by field."""

    model: ModelConfig = field(default_factory=_default_model)
    """The policy model and its initial weights."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """How the actor is split over ranks."""

    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Response generation."""

    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantages and the per-token policy loss (GRPO family, AR, Lopti, TR-GRPO, STAPO)."""

    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The optimisation loop."""

    data: DataConfig = field(default_factory=DataConfig)
    """Prompts and rewards."""

    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Run name and metrics."""

    def __post_init__(self) -> None:
        self._check_batching()
        self._check_model_fits()
        self._warn_ignored()

    @property
    def run_dir(self) -> Path:
        """Where this run writes everything: ``trainer.output_dir / logging.run_name``."""
        return Path(self.trainer.output_dir) / self.logging.run_name

    def _check_batching(self) -> None:
        samples = self.rollout.num_samples_per_step
        minibatches = self.trainer.num_minibatches_per_step
        if samples % minibatches:
            raise ConfigError(
                "trainer.num_minibatches_per_step",
                f"got {minibatches}; must divide rollout.num_prompts_per_step * rollout.num_samples_per_prompt "
                f"= {samples}",
            )
        longest = self.rollout.max_sequence_tokens
        if self.trainer.max_tokens_per_microbatch < longest:
            raise ConfigError(
                "trainer.max_tokens_per_microbatch",
                f"got {self.trainer.max_tokens_per_microbatch}; must hold one whole sequence: "
                f"rollout.max_prompt_tokens + rollout.max_new_tokens = {longest}",
            )

    def _check_model_fits(self) -> None:
        """Checks that need the architecture, possible only for the inline ``tiny`` model."""
        tiny, par = self.model.tiny, self.parallel
        if tiny is None:
            return  # an HF config is read when the model is built; it is checked there
        tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
        for name in ("num_attention_heads", "num_key_value_heads"):
            if getattr(tiny, name) % tp:
                raise ConfigError(
                    "parallel.tensor_model_parallel_size",
                    f"got {tp}; must divide model.tiny.{name} ({getattr(tiny, name)})",
                )
        if tiny.num_layers % pp:
            raise ConfigError(
                "parallel.pipeline_model_parallel_size",
                f"got {pp}; must divide model.tiny.num_layers ({tiny.num_layers})",
            )
        if self.rollout.max_sequence_tokens > tiny.max_position_embeddings:
            raise ConfigError(
                "rollout.max_new_tokens",
                f"rollout.max_prompt_tokens + rollout.max_new_tokens = {self.rollout.max_sequence_tokens} "
                f"exceeds model.tiny.max_position_embeddings ({tiny.max_position_embeddings})",
            )

    def _warn_ignored(self) -> None:
        algo = self.algorithm
        if algo.stapo.enabled and algo.kl_coef > 0.0:
            warn_config("algorithm.kl_coef", f"{algo.kl_coef} with STAPO enabled; the STAPO paper uses no KL term")
        if algo.constant_normalizer is not None and algo.aggregation != "seq_mean_token_sum_norm":
            warn_config(
                "algorithm.constant_normalizer",
                f"{algo.constant_normalizer} is ignored because algorithm.aggregation is {algo.aggregation!r}",
            )
        if self.rollout.num_samples_per_prompt == 1 and algo.advantage.estimator in ("grpo", "dr_grpo", "rloo"):
            warn_config(
                "rollout.num_samples_per_prompt",
                f"1 with the group-baseline estimator {algo.advantage.estimator!r}: a group of one has no baseline",
            )
        if self.trainer.eval_every_steps > 0 and not self.data.eval_files:
            warn_config("trainer.eval_every_steps", "is ignored because data.eval_files is empty")


def load_run_config(yaml_path: str | os.PathLike[str], overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Load a :class:`RunConfig` from ``yaml_path`` with dotted ``section.field=value`` overrides."""
    return load_config(RunConfig, yaml_path, overrides)


DOCS_PATH = Path(__file__).resolve().parent.parent / "docs" / "config.md"
"""Where the generated field reference lives in a source checkout."""


def config_reference() -> str:
    """The Markdown field reference of :class:`RunConfig` (the content of ``docs/config.md``)."""
    intro = (
        "Every field of a run config, with its type, default and meaning. A run is one YAML\n"
        "file of these sections (see `examples/tiny_cpu.yaml`); any field can be overridden on\n"
        "the command line as `section.field=value`, e.g.\n"
        "`megatron-rl train examples/tiny_cpu.yaml trainer.lr=1e-6 algorithm.ar.alpha=0.3`.\n"
        "The resolved config is saved as `config.yaml` in the run directory."
    )
    return render_docs(
        RunConfig, title="Run config reference", intro=intro, regenerate="python -m megatron_rl.config > docs/config.md"
    )


if __name__ == "__main__":
    print(config_reference(), end="")
