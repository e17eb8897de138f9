"""``RunConfig``: a whole run, one section per component, and its loader."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from megatron_rl.algo.config import AlgorithmConfig
from megatron_rl.algo.methods.compose import config_warnings
from megatron_rl.config.data import DataConfig, LoggingConfig
from megatron_rl.config.lib import ConfigError, load_config, render_docs, warn_config
from megatron_rl.config.model import ModelConfig, TinyModelConfig
from megatron_rl.config.parallel import ParallelConfig
from megatron_rl.config.rollout import RolloutConfig
from megatron_rl.config.trainer import ActorConfig, TrainerConfig


def default_model() -> ModelConfig:
    # The default run is the tiny CPU one; a `model:` section in YAML starts from
    # ModelConfig's own defaults and must name hf_config or tiny itself.
    return ModelConfig(tiny=TinyModelConfig())


FP8_ALIGN_TOKENS = {"mxfp8": 32}
"""Token alignment of FP8 GEMMs by recipe (others: 16): megatron-core's
``fp8_utils.get_fp8_align_size``, which this config layer may not import;
``tests/unit/test_fp8_padding.py`` checks the two agree."""


def check_actor_sections(model: ModelConfig, parallel: ParallelConfig, actor: ActorConfig) -> None:
    """What the actor cannot be built with, whatever trains it (``train`` or ``sft``): a
    ``ConfigError`` naming the field, never a setting left unused."""
    multiple = actor.pad_tokens_to_multiple_of
    if model.fp8 is not None and multiple is not None:
        align = FP8_ALIGN_TOKENS.get(model.fp8_recipe, 16)
        if multiple % align:
            raise ConfigError(
                "actor.pad_tokens_to_multiple_of",
                f"got {multiple}; FP8 GEMMs of model.fp8_recipe {model.fp8_recipe!r} need token counts "
                f"aligned to {align} (use a multiple of {align}, or null for the recipe's own)",
            )
    if parallel.context_parallel_size > 1:
        raise ConfigError(
            "parallel.context_parallel_size",
            f"got {parallel.context_parallel_size}; context parallelism is not supported yet",
        )
    lora = actor.lora
    if lora is None:
        return
    if model.use_te or model.fp8 is not None:
        raise ConfigError(
            "actor.lora",
            "adapters sit on megatron's local linear layers, not the Transformer-Engine spec's fused ones: "
            f"set model.use_te false or null (got {model.use_te}) and model.fp8 null (got {model.fp8!r})",
        )
    experts_targeted = sorted({"linear_fc1", "linear_fc2"} & set(lora.target_modules))
    if model.tiny is not None and model.tiny.num_experts > 0 and experts_targeted:
        raise ConfigError(
            "actor.lora.target_modules",
            f"{experts_targeted} on a mixture-of-experts model: its experts take no adapters; target attention "
            "(linear_qkv, linear_proj) only",
        )


def check_tiny_model_fits(model: ModelConfig, parallel: ParallelConfig, longest: int, field: str, what: str) -> None:
    """Checks that need the architecture, possible only for the inline ``tiny`` model (an HF
    config is read when the run starts and checked there): the layout divides its heads and
    layers, and the longest sequence (``what`` = ``longest`` tokens, set by ``field``) fits
    its positions."""
    tiny = model.tiny
    if tiny is None:
        return
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    for name in ("num_attention_heads", "num_key_value_heads"):
        if getattr(tiny, name) % tp:
            raise ConfigError(
                "parallel.tensor_model_parallel_size", f"got {tp}; must divide model.tiny.{name} ({getattr(tiny, name)})"
            )
    if tiny.num_layers % pp:
        raise ConfigError(
            "parallel.pipeline_model_parallel_size", f"got {pp}; must divide model.tiny.num_layers ({tiny.num_layers})"
        )
    if longest > tiny.max_position_embeddings:
        raise ConfigError(field, f"{what} = {longest} exceeds model.tiny.max_position_embeddings "
                          f"({tiny.max_position_embeddings})")  # fmt: skip

@dataclass(kw_only=True)
class RunConfig:
    """A whole RL run: one section per component, each documented field by field."""

    model: ModelConfig = field(default_factory=default_model)
    """The policy model, its initial weights and numerics."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """How the actor is split over ranks."""

    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Response generation."""

    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantages and the per-token policy loss (GRPO family, AR, Lopti, TR-GRPO, STAPO)."""

    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The optimisation loop and the optimizer."""

    actor: ActorConfig = field(default_factory=ActorConfig)
    """Megatron-actor settings (optimizer sharding, checkpoint format, loss chunking)."""

    data: DataConfig = field(default_factory=DataConfig)
    """Prompts and the task that scores them."""

    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Run name and metrics."""

    def __post_init__(self) -> None:
        self._check_batching()
        check_actor_sections(self.model, self.parallel, self.actor)
        check_tiny_model_fits(self.model, self.parallel, self.rollout.max_sequence_tokens,
                              "rollout.max_new_tokens", "rollout.max_prompt_tokens + rollout.max_new_tokens")  # fmt: skip
        self._check_supported()
        self._check_lora()
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

    def _check_supported(self) -> None:
        """Settings the sections accept but the run cannot act on yet: an error, never a no-op."""
        roll = self.rollout
        if roll.weight_transport == "cuda_ipc" and (roll.engine != "vllm" or roll.placement != "colocated"):
            raise ConfigError(
                "rollout.weight_transport",
                f"cuda_ipc needs rollout.engine 'vllm' and placement 'colocated' (got {roll.engine!r}, "
                f"{roll.placement!r}); use collective or object_store",
            )
        if roll.max_staleness > 0 and roll.placement != "disaggregated":
            raise ConfigError(
                "rollout.max_staleness",
                f"got {roll.max_staleness}; generating ahead needs placement: disaggregated (colocated engines "
                "and actor share the devices and take turns)",
            )
        if roll.max_staleness > 0 and roll.tis_cap is None:
            raise ConfigError(
                "rollout.tis_cap",
                f"got None with max_staleness {roll.max_staleness}; responses of older weights need the "
                "behaviour-policy correction (decoupled PPO's truncated importance weights, typically 2)",
            )

    def _check_lora(self) -> None:
        """What LoRA adapters (``actor.lora``) cannot be combined with (yet)."""
        lora = self.actor.lora
        if lora is None:
            if self.rollout.lora_sync == "adapter":
                raise ConfigError("rollout.lora_sync", "adapter: the actor has no adapters (actor.lora is null); "
                                  "use merged")  # fmt: skip
            return
        if self.actor.reference_offload:
            raise ConfigError(
                "actor.reference_offload",
                "true with actor.lora: the reference policy is the actor with its adapters off, no copy to offload",
            )

    def _warn_ignored(self) -> None:
        algo = self.algorithm
        for path, message in config_warnings(algo):  # the enabled token-weight methods'
            warn_config(f"algorithm.{path}", message)
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


DOCS_PATH = Path(__file__).resolve().parents[2] / "docs" / "config.md"
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
