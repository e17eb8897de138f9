"""``megatron-rl generate-data``: write a task's train/test prompt files.

    megatron-rl generate-data kk --num-people 3 4 5 --train-per-n 900 --test-per-n 100 --seed 0 --out DIR
    megatron-rl generate-data toy --num-train 800 --num-test 200 --num-digits 3 --seed 0 --out DIR

Writes ``DIR/train.jsonl`` and ``DIR/test.jsonl`` (and ``.parquet`` copies when pyarrow is
installed, see ``--parquet``), ``DIR/info.json`` (the arguments and row counts), and per
task: K&K also ``DIR/<N>ppl/{train,test}.jsonl`` for curricula and per-N evaluation; toy
also ``DIR/tokenizer/`` (the toy tokenizer, loadable with ``AutoTokenizer``).
Same arguments, same files: generation depends only on the seed.

There is one sub-command per registered task with a generator
(:class:`~megatron_rl.tasks.DataGenerator`, ``Task.generator``), in registration order:
what is particular to a task (its flags, checks, rows and extra files) lives with the
task in :mod:`megatron_rl.tasks`; this module adds the common flags and writes the files.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatron_rl.cli import EXIT_OK, EXIT_USAGE
from megatron_rl.data.loaders import parquet_available, write_jsonl, write_parquet
from megatron_rl.tasks import TASKS, DataGenerator, Splits


def generators() -> dict[str, DataGenerator]:
    """The registered tasks' generators by sub-command name, in registration order."""
    return {task.generator.command: task.generator for _, task in TASKS.items() if task.generator is not None}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``generate-data`` arguments (one sub-command per task)."""
    tasks = parser.add_subparsers(dest="task", metavar="TASK", required=True)
    for command, generator in generators().items():
        sub = tasks.add_parser(command, help=generator.help)
        generator.add_arguments(sub)
        sub.add_argument("--seed", type=int, default=0, help="generation seed (default: 0)")
        sub.add_argument("--out", required=True, metavar="DIR", help="output directory (created if needed)")
        sub.add_argument("--parquet", choices=("auto", "yes", "no"), default="auto",
                         help="also write .parquet files: auto = when pyarrow is installed (default)")  # fmt: skip


def _write_split_files(directory: Path, splits: Splits, *, parquet: bool) -> None:
    for split, rows in splits.items():
        write_jsonl(directory / f"{split}.jsonl", rows)
        if parquet:
            write_parquet(directory / f"{split}.parquet", rows)


def _check(args: argparse.Namespace, generator: DataGenerator) -> str | None:
    """A usage error message, or None."""
    if args.parquet == "yes" and not parquet_available():
        return "--parquet yes needs pyarrow (pip install pyarrow)"
    return generator.check(args)


def run(args: argparse.Namespace) -> int:
    """Generate the task's files; returns the exit code."""
    generator = generators()[args.task]
    error = _check(args, generator)
    if error is not None:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    out = Path(args.out)
    parquet = args.parquet == "yes" or (args.parquet == "auto" and parquet_available())
    try:
        splits = generator.generate(args)
    except (ValueError, RuntimeError) as e:  # e.g. more distinct puzzles/targets asked than exist
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    _write_split_files(out, splits, parquet=parquet)
    for name, subset in generator.subsets(splits, args).items():
        _write_split_files(out / name, subset, parquet=parquet)
    generator.write_extras(out, args)
    info = {
        "task": args.task,
        "arguments": {k: v for k, v in vars(args).items() if k not in ("run", "command")},
        "rows": {split: len(rows) for split, rows in splits.items()},
    }
    (out / "info.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {', '.join(f'{len(rows)} {split}' for split, rows in splits.items())} rows to {out}", file=sys.stderr)
    return EXIT_OK
