"""The ``data`` section (prompts and the task that scores them) and the ``logging`` section."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from megatron_rl.config.lib import (
    MAX_TIMEOUT_S,
    ConfigError,
    check_literals,
    renamed_fields,
    require_range,
)
from megatron_rl.config.model import require_positive_ints


@dataclass(kw_only=True)
class PromptFilesConfig:
    """What the ``data`` sections of RL and SFT runs share: the files, the prompt column,
    the task whose prompt style templates it, and the order rows are drawn in."""

    train_files: list[str] = field(default_factory=list)
    """Training files (``.jsonl`` or ``.parquet``), read in order and concatenated."""

    eval_files: list[str] = field(default_factory=list)
    """Evaluation files, every ``trainer.eval_every_steps`` steps: an RL run scores the
    responses to their prompts, an SFT run measures the likelihood of their responses."""

    prompt_key: str = "prompt"
    """Column (key) of a row holding the prompt text."""

    task: str = "kk_logic"
    """The task: its prompt style, reward and eval grouping. A registered task
    (``kk_logic``, ``math``, ``toy_copy``, or one a user registered), or
    ``package.module:function`` for a user reward function (then a plain task: no system
    prompt, no pre-fill); checked against the registry when the run starts. Formerly
    ``data.reward``, which is still accepted."""

    prompt_template: Literal["chat", "literal", "none"] = "chat"
    """``chat``: the prompt as a user message in the tokenizer's chat template; ``literal``:
    the task's own fixed template (as in the papers' code), without the tokenizer's;
    ``none``: the prompt text is tokenised as is."""

    shuffle: bool = True
    """Shuffle training rows (seeded by ``trainer.seed``) each pass over the data."""

    def __post_init__(self) -> None:
        check_literals(self)
        if not self.prompt_key:
            raise ConfigError("prompt_key", "got ''; must name a column")
        name = self.task
        if ":" in name:
            module, _, func = name.partition(":")
            if not module or not func or ":" in func:
                raise ConfigError("task", f"got {name!r}; a user reward is written 'package.module:function'")
        elif not name:
            raise ConfigError("task", "got ''; must be a registered task name or 'module:function'")


@renamed_fields(reward="task")
@dataclass(kw_only=True)
class DataConfig(PromptFilesConfig):
    """Training and evaluation prompts, how they are templated, and the task that scores them."""

    ground_truth_key: str = "ground_truth"
    """Column (key) of a row holding what the reward function compares against."""

    reward_modules: list[str] = field(default_factory=list)
    """Modules (or packages, with their submodules) whose functions may be named as
    ``data.task: module:function`` without the ``@megatron_rl.rewards.reward`` decorator;
    any other user reward must be declared with it, so model output is only passed to a
    function someone declared a reward. Python's ``builtins`` and modules that run code
    or commands (``os``, ``subprocess``, ...) are refused even here."""

    reward_timeout_s: float = 10.0
    """Time limit for scoring one response; a response past it scores as a failed parse
    (and is counted in ``reward/timeouts``). At most 86400 (a day)."""

    reward_memory_mb: int = 4096
    """Each reward worker's address-space cap in MiB (``setrlimit(RLIMIT_AS)``): a reward
    allocating past it gets a ``MemoryError`` and the response scores as a failure. Reward
    workers are also the first the kernel's OOM killer takes (``oom_score_adj`` 1000), not
    the actor or the engines. 0: no cap."""

    max_abs_reward: float = 1e6
    """A score beyond ±this is counted as a reward error naming the reward (it scores the
    reward's ``failure_score``), not trained on: a finite but absurd reward (1e308)
    overflows the advantages into a non-finite loss."""

    num_reward_workers: int = 2
    """Worker processes that score responses (model output is parsed there, never
    executed); at most 512."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require_range("reward_timeout_s", self.reward_timeout_s, gt=0.0, le=MAX_TIMEOUT_S)
        require_range("num_reward_workers", self.num_reward_workers, ge=1, le=512)
        require_range("reward_memory_mb", self.reward_memory_mb, ge=0, le=1 << 24)
        require_range("max_abs_reward", self.max_abs_reward, gt=0.0)
        if not self.ground_truth_key:
            raise ConfigError("ground_truth_key", "got ''; must name a column")
        for i, module in enumerate(self.reward_modules):
            if not isinstance(module, str) or not all(part.isidentifier() for part in module.split(".")):
                raise ConfigError(f"reward_modules[{i}]", f"got {module!r}; must be a module name like 'my_pkg.rewards'")


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
        require_positive_ints(self, "log_every_steps")
        name = self.run_name
        if not name or name in (".", "..") or "/" in name or (os.sep in name) or "\\" in name:
            raise ConfigError("run_name", f"got {name!r}; must be a plain directory name (no path separators)")
