"""``megatron-rl generate-data``: write a task's train/test prompt files.

    megatron-rl generate-data kk --num-people 3 4 5 --train-per-n 900 --test-per-n 100 --seed 0 --out DIR
    megatron-rl generate-data toy --num-train 800 --num-test 200 --num-digits 3 --seed 0 --out DIR

Writes ``DIR/train.jsonl`` and ``DIR/test.jsonl`` (and ``.parquet`` copies when pyarrow is
installed, see ``--parquet``), ``DIR/info.json`` (the arguments and row counts), and per
task: K&K also ``DIR/<N>ppl/{train,test}.jsonl`` for curricula and per-N evaluation; toy
also ``DIR/tokenizer/`` (the toy tokenizer, loadable with ``AutoTokenizer``).
Same arguments, same files: generation depends only on the seed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from megatron_rl.cli import EXIT_OK, EXIT_USAGE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``generate-data`` arguments (one sub-command per task)."""
    tasks = parser.add_subparsers(dest="task", metavar="TASK", required=True)

    kk = tasks.add_parser("kk", help="Knights-and-Knaves puzzles with unique solutions (Logic-RL format)")
    kk.add_argument("--num-people", type=int, nargs="+", default=[3, 4, 5, 6, 7], metavar="N",
                    help="puzzle sizes to generate (default: 3 4 5 6 7)")  # fmt: skip
    kk.add_argument("--train-per-n", type=int, default=900, help="training puzzles per size (default: 900)")
    kk.add_argument("--test-per-n", type=int, default=100, help="test puzzles per size (default: 100)")

    toy = tasks.add_parser("toy", help="the CPU demo's copy-the-digits task, plus its tokenizer")
    toy.add_argument("--num-train", type=int, default=800, help="training prompts (default: 800)")
    toy.add_argument("--num-test", type=int, default=200, help="test prompts (default: 200)")
    toy.add_argument("--num-digits", type=int, default=3, help="digits to copy per prompt (default: 3)")

    for sub in (kk, toy):
        sub.add_argument("--seed", type=int, default=0, help="generation seed (default: 0)")
        sub.add_argument("--out", required=True, metavar="DIR", help="output directory (created if needed)")
        sub.add_argument("--parquet", choices=("auto", "yes", "no"), default="auto",
                         help="also write .parquet files: auto = when pyarrow is installed (default)")  # fmt: skip


def _write_split_files(directory: Path, splits: dict[str, list[dict[str, Any]]], *, parquet: bool) -> list[Path]:
    from megatron_rl.data.loaders import write_jsonl, write_parquet

    written = []
    for split, rows in splits.items():
        written.append(write_jsonl(directory / f"{split}.jsonl", rows))
        if parquet:
            written.append(write_parquet(directory / f"{split}.parquet", rows))
    return written


def _check(args: argparse.Namespace) -> str | None:
    """A usage error message, or None."""
    from megatron_rl.data import kk
    from megatron_rl.data.loaders import parquet_available

    if args.parquet == "yes" and not parquet_available():
        return "--parquet yes needs pyarrow (pip install pyarrow)"
    if args.task == "kk":
        bad = [n for n in args.num_people if not kk.MIN_PEOPLE <= n <= kk.MAX_PEOPLE]
        if bad:
            return f"--num-people {bad}: sizes must be in [{kk.MIN_PEOPLE}, {kk.MAX_PEOPLE}]"
        if len(set(args.num_people)) != len(args.num_people):
            return f"--num-people {args.num_people} has duplicates"
        counts = {"--train-per-n": args.train_per_n, "--test-per-n": args.test_per_n}
    else:
        if args.num_digits < 1:
            return f"--num-digits must be >= 1, got {args.num_digits}"
        counts = {"--num-train": args.num_train, "--num-test": args.num_test}
    for flag, value in counts.items():
        if value < 0:
            return f"{flag} must be >= 0, got {value}"
    return None


def run(args: argparse.Namespace) -> int:
    """Generate the task's files; returns the exit code."""
    from megatron_rl.data import kk, toy
    from megatron_rl.data.loaders import parquet_available

    error = _check(args)
    if error is not None:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    out = Path(args.out)
    parquet = args.parquet == "yes" or (args.parquet == "auto" and parquet_available())
    try:
        if args.task == "kk":
            splits = kk.generate_splits(
                args.num_people, train_per_n=args.train_per_n, test_per_n=args.test_per_n, seed=args.seed
            )
        else:
            splits = toy.generate_splits(
                num_train=args.num_train, num_test=args.num_test, num_digits=args.num_digits, seed=args.seed
            )
    except (ValueError, RuntimeError) as e:  # e.g. more distinct puzzles/targets asked than exist
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    written = _write_split_files(out, splits, parquet=parquet)
    if args.task == "kk":
        for n in args.num_people:
            per_n = {split: [r for r in rows if r["num_people"] == n] for split, rows in splits.items()}
            written += _write_split_files(out / f"{n}ppl", per_n, parquet=parquet)
    else:
        written.append(toy.save_toy_tokenizer(out / "tokenizer"))
    info = {
        "task": args.task,
        "arguments": {k: v for k, v in vars(args).items() if k not in ("run", "command")},
        "rows": {split: len(rows) for split, rows in splits.items()},
    }
    (out / "info.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {', '.join(f'{len(rows)} {split}' for split, rows in splits.items())} rows to {out}", file=sys.stderr)
    return EXIT_OK
