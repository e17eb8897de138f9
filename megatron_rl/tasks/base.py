"""The :class:`Task` type, the task registry, and :func:`get_task` (config ``data.task``).

A task bundles what one kind of prompt needs: its reward function, its prompt style
(system prompt and assistant pre-fill), the group its rows' eval accuracy is reported
under, and optionally a generator for ``megatron-rl generate-data``. Built-in tasks
register through :func:`register_task` exactly as a user task does.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_rl.config.lib import Registry, UnknownNameError
from megatron_rl.data.loaders import PromptRow
from megatron_rl.data.prompts import PLAIN_STYLE, PromptStyle
from megatron_rl.rewards.registry import RewardFunction, import_by_path, reward_from_callable

Splits = dict[str, list[dict[str, Any]]]
"""Rows of a generated dataset by split name (``{"train": rows, "test": rows}``)."""


def all_rows(row: PromptRow) -> str:
    """The eval group of every row when a task has no finer grouping: ``"all"``."""
    return "all"


def no_subsets(splits: Splits, args: argparse.Namespace) -> dict[str, Splits]:
    """A generator writing no per-subset files."""
    return {}


def no_extras(out: Path, args: argparse.Namespace) -> None:
    """A generator writing no files besides the splits."""


def check_counts(args: argparse.Namespace, *flags: str) -> str | None:
    """``"--flag must be >= 0, got N"`` for the first of the count ``flags`` that is negative, else None."""
    for flag in flags:
        value = getattr(args, flag.removeprefix("--").replace("-", "_"))
        if value < 0:
            return f"{flag} must be >= 0, got {value}"
    return None


@dataclass(kw_only=True, frozen=True)
class DataGenerator:
    """How ``megatron-rl generate-data COMMAND`` writes a task's prompt files.

    The command adds ``--seed``, ``--out`` and ``--parquet`` after the generator's own
    flags, checks them with :attr:`check`, writes ``OUT/{train,test}.jsonl`` (and
    ``.parquet``) from :attr:`generate`, the subsets of :attr:`subsets` under
    ``OUT/<name>/``, then :attr:`write_extras`, and ``OUT/info.json``.
    """

    command: str
    """The ``generate-data`` sub-command (``kk``, ``toy``)."""

    help: str
    """One line for ``--help``."""

    add_arguments: Callable[[argparse.ArgumentParser], None]
    """Adds the generator's own flags to its sub-command's parser."""

    check: Callable[[argparse.Namespace], str | None]
    """A usage error message for the parsed flags, or None when they are fine."""

    generate: Callable[[argparse.Namespace], Splits]
    """The rows by split; a ``ValueError`` or ``RuntimeError`` (e.g. more distinct rows
    asked than exist) is reported as a usage error. Depends only on the flags (the seed)."""

    subsets: Callable[[Splits, argparse.Namespace], dict[str, Splits]] = no_subsets
    """Extra split files by sub-directory name (K&K: one ``<N>ppl/`` per puzzle size)."""

    write_extras: Callable[[Path, argparse.Namespace], None] = no_extras
    """Writes files besides the rows into the output directory (toy: the tokenizer)."""


@dataclass(kw_only=True, frozen=True)
class Task:
    """One kind of prompt: how it is shown to the model, scored and reported."""

    name: str
    """The registered name (config ``data.task``), or the ``module:attr`` spec it was loaded from."""

    reward: RewardFunction
    """Scores a response against its row's ground truth."""

    prompt_style: PromptStyle = PLAIN_STYLE
    """System prompt and assistant pre-fill the prompt template puts around the question."""

    eval_group: Callable[[PromptRow], str] = all_rows
    """The group a row's eval accuracy is reported under (``eval/accuracy/<group>/...``)."""

    generator: DataGenerator | None = None
    """How ``megatron-rl generate-data`` writes this task's data; None when it cannot."""


class UnknownTaskError(UnknownNameError):
    """Raised for a name no task is registered under; lists the registered ones."""


TASKS: Registry[Task] = Registry(
    "task",
    unknown_error=UnknownTaskError,
    unknown_hint="(or give a user Task or reward function as 'package.module:name')",
)
"""Registered tasks by name (the built-ins register when :mod:`megatron_rl.tasks` is imported)."""


def register_task(task: Task) -> Task:
    """Register ``task`` under ``task.name`` and return it; a second registration raises ValueError."""
    if ":" in task.name:
        raise ValueError(f"task name {task.name!r} must contain no ':' (that marks 'module:name')")
    return TASKS.register(task.name, task)


def registered_tasks() -> list[str]:
    """Names of all registered tasks, sorted."""
    return TASKS.names()


def get_task(name: str, *, trusted_modules: Sequence[str] = ()) -> Task:
    """Resolve config ``data.task`` (``trusted_modules``: ``data.reward_modules``).

    - a registered task name -> that task;
    - ``package.module:attr`` where ``attr`` is a :class:`Task` -> that task (not registered);
    - ``package.module:function``, a user reward function (declared with
      ``@megatron_rl.rewards.reward``, or from a trusted module) -> a plain task named by
      the spec: that reward, no system prompt, no pre-fill, eval group ``"all"``.

    Raises:
        UnknownTaskError: no task is registered under ``name`` (lists the registered ones).
        RewardLoadError: a ``module:attr`` spec that cannot be imported, or names neither a
            task nor a usable reward function (the message names the spec).
    """
    if ":" not in name:
        return TASKS.get(name)
    obj = import_by_path(name)
    if isinstance(obj, Task):
        return obj
    return Task(name=name, reward=reward_from_callable(name, obj, trusted_modules=trusted_modules))
