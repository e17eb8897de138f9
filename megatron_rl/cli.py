"""The ``megatron-rl`` command line: one entry point with subcommands.

    megatron-rl train CONFIG [section.field=value ...] [--dry-run]
    megatron-rl convert hf-to-mcore --hf DIR --out DIR [--tp N --pp M]
    megatron-rl convert mcore-to-hf --mcore DIR --out DIR [--hf-config DIR]
    megatron-rl generate-data {kk,toy} --out DIR ...
    megatron-rl --version

Subcommands live in a small registry (:func:`register_subcommand`), so ``convert``,
``eval`` and ``generate-data`` can be added by their own modules without touching the
others. To add one, write ``add_arguments(parser)`` and ``run(args) -> exit code`` and
register them at the bottom of this file; import heavy modules inside ``run`` so that
``megatron-rl --help`` stays fast.

Exit codes: 0 success; 1 the command could not do its job; 2 bad usage or a bad config
(``error: ...`` on stderr, no traceback: a config error is the user's to fix, not a bug).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from megatron_rl.configlib import ConfigError, ConfigWarning, dump_yaml, save_resolved, warn_config

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2


@dataclass(frozen=True)
class Subcommand:
    """One ``megatron-rl`` subcommand."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


SUBCOMMANDS: dict[str, Subcommand] = {}
"""Registered subcommands by name, in registration (and ``--help``) order."""


def register_subcommand(
    name: str,
    *,
    help: str,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int],
) -> Subcommand:
    """Add subcommand ``name``; ``run(args)`` returns the exit code. A second registration raises."""
    if name in SUBCOMMANDS:
        raise ValueError(f"subcommand {name!r} is already registered")
    SUBCOMMANDS[name] = sub = Subcommand(name=name, help=help, add_arguments=add_arguments, run=run)
    return sub


def package_version() -> str:
    """The installed version of megatron_rl."""
    try:
        return importlib.metadata.version("megatron_rl")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every registered subcommand."""
    parser = argparse.ArgumentParser(
        prog="megatron-rl", description="Megatron-core RL post-training (GRPO family) for LLMs."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for sub in SUBCOMMANDS.values():
        sub_parser = subparsers.add_parser(sub.name, help=sub.help, description=sub.help)
        sub.add_arguments(sub_parser)
        sub_parser.set_defaults(run=sub.run)
    return parser


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    # Config warnings are messages for the user, not for a developer: no file/line noise.
    if issubclass(category, ConfigWarning):
        print(f"warning: {message}", file=sys.stderr)
    else:
        print(warnings.formatwarning(message, category, filename, lineno, line), file=sys.stderr, end="")


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``megatron-rl`` with ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    parser = build_parser()
    # parse_known_args: argparse cannot take positionals after an option (``train CFG
    # --dry-run a.b=c``), so overrides given after an option arrive as extras.
    args, extras = parser.parse_known_args(argv)
    if extras:
        if hasattr(args, "overrides") and all("=" in x and not x.startswith("-") for x in extras):
            args.overrides = list(args.overrides) + extras
        else:
            parser.error(f"unrecognized arguments: {' '.join(extras)}")
    if getattr(args, "run", None) is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    with warnings.catch_warnings():
        warnings.simplefilter("always", ConfigWarning)
        warnings.showwarning = _show_warning
        try:
            return args.run(args)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return EXIT_USAGE


# --------------------------------------------------------------------------- train


def _add_train_arguments(parser: argparse.ArgumentParser) -> None:
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


def check_registries(config) -> None:
    """Check names that are resolved through registries (not knowable from the config alone).

    Raises :class:`ConfigError` naming the field, and listing the registered names.
    """
    # Imported here: it pulls in torch, which ``--help`` and config errors do not need.
    from megatron_rl.algo.advantages import UnknownEstimatorError, get_advantage_estimator

    from megatron_rl.rewards import RewardLoadError, UnknownRewardError, get_reward

    try:
        get_advantage_estimator(config.algorithm.advantage.estimator)
    except UnknownEstimatorError as e:
        raise ConfigError("algorithm.advantage.estimator", str(e)) from None
    try:
        get_reward(config.data.reward)
    except (UnknownRewardError, RewardLoadError) as e:
        raise ConfigError("data.reward", str(e)) from None


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


def _run_train(args: argparse.Namespace) -> int:
    from megatron_rl.config import load_run_config

    config = load_run_config(args.config, args.overrides)
    check_registries(config)
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


register_subcommand(
    "train",
    help="train a policy with RL from a run config (--dry-run: validate and save the config only)",
    add_arguments=_add_train_arguments,
    run=_run_train,
)


# --------------------------------------------------------------------------- module subcommands


def register_module_subcommand(name: str, module: str, *, help: str) -> Subcommand:
    """Register ``name`` as the ``add_arguments(parser)`` / ``run(args)`` pair of ``module``,
    imported only when the parser is built or the command runs."""
    import importlib

    return register_subcommand(
        name,
        help=help,
        add_arguments=lambda parser: importlib.import_module(module).add_arguments(parser),
        run=lambda args: importlib.import_module(module).run(args),
    )


register_module_subcommand(
    "convert",
    "megatron_rl.convert",  # imports torch (about 1 s), not megatron-core
    help="convert checkpoints: hf-to-mcore (HF safetensors -> megatron dist-checkpoint) or mcore-to-hf",
)
register_module_subcommand(
    "generate-data",
    "megatron_rl.data.cli",
    help="write prompt datasets: kk (Knights-and-Knaves puzzles) or toy (the CPU demo task)",
)

if __name__ == "__main__":
    sys.exit(main())
