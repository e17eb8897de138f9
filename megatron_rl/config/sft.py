"""``SFTRunConfig``: a supervised fine-tuning run (``megatron-rl sft``) and its loader.

An SFT run trains the same Megatron actor as an RL run (``model``, ``parallel``,
``trainer``, ``actor`` and ``logging`` are the RL run's sections, checked alike) on
prompt/response rows (``data``: :class:`SFTDataConfig`); its checkpoints are what
``model.checkpoint`` of ``megatron-rl train`` takes. Settings of those sections that only
an RL run acts on are refused when set (``ConfigError`` naming the field), never ignored.
"""

from __future__ import annotations

import os
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

from megatron_rl.config.data import LoggingConfig, PromptFilesConfig
from megatron_rl.config.lib import ConfigError, load_config, render_docs, require_range, warn_config
from megatron_rl.config.model import ModelConfig, require_positive_ints
from megatron_rl.config.parallel import ParallelConfig
from megatron_rl.config.run import check_actor_sections, check_tiny_model_fits, default_model
from megatron_rl.config.trainer import ActorConfig, TrainerConfig

__all__ = ["SFTDataConfig", "SFTRunConfig", "load_sft_config"]


@dataclass(kw_only=True)
class SFTDataConfig(PromptFilesConfig):
    """Prompt/response rows: the prompt is templated as the RL run's engines see it (the
    task's system prompt and pre-fill, ``prompt_template``), the response follows it and
    ends with the tokenizer's end-of-sequence token; the loss is on the response's tokens."""

    response_key: str = "response"
    """Column (key) of a row holding the response text (what follows the rendered prompt,
    pre-fill excluded: for K&K, the text after ``<think>``)."""

    rows_per_step: int = 32
    """Rows (prompt + response) per optimizer step, over all data-parallel ranks."""

    max_sequence_tokens: int = 512
    """Longest row, prompt + response + end-of-sequence token; a longer row is an error
    naming its file and row before the run starts (rows are never cut)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.response_key:
            raise ConfigError("response_key", "got ''; must name a column")
        if self.response_key == self.prompt_key:
            raise ConfigError("response_key", f"got {self.response_key!r}, the prompt's column too")
        require_positive_ints(self, "rows_per_step", "max_sequence_tokens")
        require_range("rows_per_step", self.rows_per_step, ge=1, le=1 << 20)
        require_range("max_sequence_tokens", self.max_sequence_tokens, ge=2, le=1 << 24)


_RL_ONLY = {
    "trainer": {
        "num_minibatches_per_step": "an SFT step is one optimizer step over data.rows_per_step rows",
        "num_epochs_per_step": "an SFT step is one optimizer step over data.rows_per_step rows",
        "max_consecutive_reward_error_steps": "an SFT run scores nothing",
    },
    "actor": {
        "old_logp_source": "an SFT run has no old policy",
        "reference_offload": "an SFT run has no reference policy",
    },
    "logging": {"token_diagnostics": "the token-probability diagnostics are the RL update's"},
}
"""Fields of the shared sections only an RL run acts on, and why: an SFT config that sets
one (to anything but its default) is refused."""


def _default_of(section: object, name: str) -> object:
    f = next(f for f in fields(section) if f.name == name)
    return f.default_factory() if f.default is MISSING else f.default  # type: ignore[misc]


@dataclass(kw_only=True)
class SFTRunConfig:
    """A whole SFT run: the RL run's model, layout, optimizer, actor and logging sections,
    and prompt/response data."""

    model: ModelConfig = field(default_factory=default_model)
    """The model, its initial weights and numerics (as in an RL run)."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """How the actor is split over ranks."""

    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Steps (``num_steps``: optimizer steps), the optimizer, micro-batches, checkpoints,
    resume; ``eval_every_steps`` measures the likelihood of ``data.eval_files``."""

    actor: ActorConfig = field(default_factory=ActorConfig)
    """Megatron-actor settings (optimizer sharding, checkpoint format, loss kernel, LoRA)."""

    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    """Prompt/response rows."""

    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Run name and metrics."""

    def __post_init__(self) -> None:
        for section, names in _RL_ONLY.items():
            obj = getattr(self, section)
            for name, why in names.items():
                if getattr(obj, name) != _default_of(obj, name):
                    raise ConfigError(f"{section}.{name}", f"got {getattr(obj, name)!r}; {why}: leave it unset")
        check_actor_sections(self.model, self.parallel, self.actor)
        longest = self.data.max_sequence_tokens
        check_tiny_model_fits(self.model, self.parallel, longest, "data.max_sequence_tokens", "data.max_sequence_tokens")
        if self.trainer.max_tokens_per_microbatch < longest:
            raise ConfigError("trainer.max_tokens_per_microbatch", f"got {self.trainer.max_tokens_per_microbatch}; must "
                              f"hold one whole row: data.max_sequence_tokens = {longest}")  # fmt: skip
        dp = self.parallel.resolved_data_parallel_size
        if self.data.rows_per_step < dp:
            raise ConfigError("data.rows_per_step", f"got {self.data.rows_per_step}; each of the {dp} data-parallel "
                              "ranks needs a row")  # fmt: skip
        if self.trainer.eval_every_steps > 0 and not self.data.eval_files:
            warn_config("trainer.eval_every_steps", "is ignored because data.eval_files is empty")

    @property
    def run_dir(self) -> Path:
        """Where this run writes everything: ``trainer.output_dir / logging.run_name``."""
        return Path(self.trainer.output_dir) / self.logging.run_name


def load_sft_config(yaml_path: str | os.PathLike[str], overrides: list[str] | tuple[str, ...] = ()) -> SFTRunConfig:
    """Load an :class:`SFTRunConfig` from ``yaml_path`` with dotted ``section.field=value`` overrides."""
    return load_config(SFTRunConfig, yaml_path, overrides)


def sft_config_reference() -> str:
    """The Markdown field reference of :class:`SFTRunConfig` (``docs/sft_config.md``)."""
    intro = (
        "Every field of an SFT run config (`megatron-rl sft CONFIG`). The `model`, `parallel`,\n"
        "`trainer`, `actor` and `logging` sections are an RL run's (docs/config.md); a field only\n"
        "an RL run acts on is refused when set. Override any field as `section.field=value`."
    )
    return render_docs(SFTRunConfig, title="SFT run config reference", intro=intro,
                       regenerate="python -m megatron_rl.config sft > docs/sft_config.md")  # fmt: skip
