"""The ``megatron-rl`` command line: one entry point with subcommands.

    megatron-rl train CONFIG [section.field=value ...] [--dry-run]
    megatron-rl sft CONFIG [section.field=value ...] [--dry-run]
    megatron-rl plan CONFIG [overrides] [--gpu-memory-gb N]
    megatron-rl sweep CONFIG --methods M1,M2 --seeds N [--launcher local|slurm] [overrides]
    megatron-rl convert hf-to-mcore --hf DIR --out DIR [--tp N --pp M]
    megatron-rl convert mcore-to-hf --mcore DIR --out DIR [--hf-config DIR]
    megatron-rl generate-data {kk,toy} --out DIR ...
    megatron-rl --version

Each subcommand is a module of this package (``train``, ``convert``, ``generate_data``)
with ``add_arguments(parser)`` and ``run(args) -> exit code``, registered at the bottom of
this file (:func:`register_module_subcommand`); any other can be added with
:func:`register_subcommand` without touching the others. Modules import heavy code inside
``run`` so that ``megatron-rl --help`` stays fast. This package is the front end only: no
library module imports it.

Exit codes: 0 success; 1 the command could not do its job; 2 bad usage or a bad config
(``error: ...`` on stderr, no traceback: a config error is the user's to fix, not a bug);
3 (``train``, ``sft``) stopped by a signal after writing a checkpoint.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from megatron_rl.config.lib import ConfigError, ConfigRenameWarning, ConfigWarning

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_STOPPED = 3
"""``train``: stopped by a signal after a checkpoint; rerunning the command continues the run."""


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


def register_module_subcommand(name: str, module: str, *, help: str) -> Subcommand:
    """Register ``name`` as the ``add_arguments(parser)`` / ``run(args)`` pair of ``module``,
    imported only when the parser is built or the command runs."""
    return register_subcommand(
        name,
        help=help,
        add_arguments=lambda parser: importlib.import_module(module).add_arguments(parser),
        run=lambda args: importlib.import_module(module).run(args),
    )


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
    # Config warnings and renamed-field notices are messages for the user, not for a
    # developer: no file/line noise.
    if issubclass(category, (ConfigWarning, ConfigRenameWarning)):
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
        warnings.simplefilter("always", ConfigRenameWarning)
        warnings.showwarning = _show_warning
        try:
            return args.run(args)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return EXIT_USAGE


register_module_subcommand(
    "train",
    "megatron_rl.cli.train",
    help="train a policy with RL from a run config (--dry-run: validate and save the config only)",
)
register_module_subcommand(
    "sft",
    "megatron_rl.cli.sft",
    help="supervised fine-tuning on prompt/response rows, the warm start of an RL run (--dry-run: validate only)",
)
register_module_subcommand(
    "convert",
    "megatron_rl.cli.convert",  # the conversion library (torch) is imported when it runs
    help="convert checkpoints: hf-to-mcore (HF safetensors -> megatron dist-checkpoint) or mcore-to-hf",
)
register_module_subcommand(
    "plan", "megatron_rl.cli.plan", help="predict the actor's memory per GPU for a config (exit 1: does not fit)"
)
register_module_subcommand(
    "sweep", "megatron_rl.cli.sweep", help="train a config with several methods x seeds, then compare them"
)
register_module_subcommand(
    "generate-data",
    "megatron_rl.cli.generate_data",
    help="write prompt datasets: kk (Knights-and-Knaves puzzles) or toy (the CPU demo task)",
)
