"""``megatron-rl train``: validate a run config, then train (or, with ``--dry-run``, save it).

    megatron-rl train CONFIG [section.field=value ...] [--dry-run]

Before any process starts, the config is loaded (errors name file and line) and the
names resolved through registries are checked (:func:`check_registries`): the task, the
advantage estimator and the model type. Missing data files are warnings, not errors (the
data may be generated later, or live on a file system only the cluster sees).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

from megatron_rl.commands import EXIT_FAILURE, EXIT_OK, EXIT_USAGE
from megatron_rl.configlib import ConfigError, ConfigRenameWarning, dump_yaml, save_resolved, warn_config

TASK_KEY = "data.task"
"""The config field naming the task (formerly ``data.reward``, still accepted)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``train`` arguments."""
    parser.add_argument("config", metavar="CONFIG", help="run config YAML file (see docs/config.md)")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="section.field=value",
        help="override any config field, e.g. trainer.lr=1e-6 algorithm.ar.alpha=0.3 (values are YAML)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="validate the config and placement, print the resolved config and save it to the run "
        "directory; train nothing",
    )


def check_registries(config, *, task_key: str = TASK_KEY) -> None:
    """Check names that are resolved through registries (not knowable from the config alone).

    Raises :class:`ConfigError` naming the field (the task under ``task_key``: the key the
    user wrote it as) and listing the registered names.
    """
    # Imported here: they pull in torch, which ``--help`` and config errors do not need.
    from megatron_rl.algo.advantages import UnknownEstimatorError, get_advantage_estimator
    from megatron_rl.rewards import RewardLoadError
    from megatron_rl.tasks import UnknownTaskError, get_task

    try:
        get_advantage_estimator(config.algorithm.advantage.estimator)
    except UnknownEstimatorError as e:
        raise ConfigError("algorithm.advantage.estimator", str(e)) from None
    try:
        get_task(config.data.task)
    except (UnknownTaskError, RewardLoadError) as e:
        raise ConfigError(task_key, str(e)) from None
    _check_model_type(config)


def _check_model_type(config) -> None:
    """The model's ``model_type`` (inline, or from the ``hf_config`` file) has a registered adapter."""
    from megatron_rl.configlib import UnknownNameError
    from megatron_rl.models.registry import ADAPTERS

    if config.model.tiny is not None:
        key, model_type, source = "model.tiny.model_type", config.model.tiny.model_type, ""
    else:
        key = "model.hf_config"
        path = Path(config.model.hf_config)
        path = path / "config.json" if path.is_dir() else path
        source = f"{path}: "
        try:
            hf_config = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(key, f"{path} does not exist") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(key, f"cannot read {path}: {type(e).__name__}: {e}") from None
        model_type = hf_config.get("model_type") if isinstance(hf_config, dict) else None
        if not isinstance(model_type, str) or not model_type:
            raise ConfigError(key, f"{path} has no 'model_type' string")
    try:
        ADAPTERS.get(model_type)
    except UnknownNameError as e:
        raise ConfigError(key, f"{source}{e}") from None


@contextlib.contextmanager
def renamed_fields_used() -> Iterator[dict[str, str]]:
    """Collect ``{current path: path as written}`` of every renamed config field given by
    its old name while the block runs; the rename notices are still shown."""
    renamed: dict[str, str] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("always", ConfigRenameWarning)
        show = warnings.showwarning

        def record(message, category, filename, lineno, file=None, line=None) -> None:
            if isinstance(message, ConfigRenameWarning):
                renamed[message.new_path] = message.path
            show(message, category, filename, lineno, file, line)

        warnings.showwarning = record
        yield renamed


def _check_data_files(config) -> None:
    # Warnings, not errors: data may be generated later or live on a file system that only
    # the cluster sees. Relative paths are relative to the working directory.
    if not config.data.train_files:
        warn_config("data.train_files", "is empty; the run has no training prompts")
    for key in ("train_files", "eval_files"):
        for i, name in enumerate(getattr(config.data, key)):
            if not Path(name).exists():
                warn_config(f"data.{key}[{i}]", f"file {name!r} does not exist (yet)")


def _placement_summary(config) -> str:
    par, roll, trainer = config.parallel, config.rollout, config.trainer
    return (
        f"actor: {par.num_actor_ranks} rank(s) = TP {par.tensor_model_parallel_size} x "
        f"PP {par.pipeline_model_parallel_size} x CP {par.context_parallel_size} x "
        f"DP {par.resolved_data_parallel_size}\n"
        f"rollout: {roll.num_engines} {roll.engine} engine(s), {roll.placement}\n"
        f"batch: {roll.num_prompts_per_step} prompts x {roll.num_samples_per_prompt} samples = "
        f"{roll.num_samples_per_step} responses per step, {trainer.num_minibatches_per_step} mini-batch(es) "
        f"x {trainer.num_epochs_per_step} epoch(s)"
    )


def _print_yaml(text: str) -> None:
    if sys.stdout.isatty():
        from rich.console import Console
        from rich.syntax import Syntax

        Console().print(Syntax(text, "yaml", background_color="default"))
    else:
        sys.stdout.write(text)
        sys.stdout.flush()


def run(args: argparse.Namespace) -> int:
    """Validate the config, then train or (``--dry-run``) print and save it; returns the exit code."""
    from megatron_rl.config import load_run_config

    with renamed_fields_used() as renamed:
        config = load_run_config(args.config, args.overrides)
    check_registries(config, task_key=renamed.get(TASK_KEY, TASK_KEY))
    _check_data_files(config)
    if not args.dry_run:
        return _train(config)
    _print_yaml(dump_yaml(config))
    saved = save_resolved(config, config.run_dir)
    print(_placement_summary(config), file=sys.stderr)
    print(f"dry run: config is valid; resolved config saved to {saved}", file=sys.stderr)
    return EXIT_OK


def _train(config) -> int:
    # Imported here: the trainer pulls in Ray, megatron-core and transformers.
    from megatron_rl.data.loaders import DataError
    from megatron_rl.rewards import RewardLoadError
    from megatron_rl.trainer import NonFiniteStepsError, Trainer

    try:
        trainer = Trainer(config)
    except (DataError, RewardLoadError, FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        trainer.run()
    except NonFiniteStepsError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAILURE
    finally:
        trainer.close()
    print(
        f"done: metrics in {config.run_dir / 'metrics.jsonl'}, checkpoints in {config.run_dir / 'checkpoints'}; "
        f"plot with: python tools/plot_run.py {config.run_dir}",
        file=sys.stderr,
    )
    return EXIT_OK
