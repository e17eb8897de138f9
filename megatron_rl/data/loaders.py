"""Reading and writing prompt datasets (``.jsonl``, ``.parquet``).

A row is a JSON object (a parquet record) with a prompt string and a ground truth; the
column names are configurable (``data.prompt_key``, ``data.ground_truth_key``) and may be
dotted paths into nested objects (``reward_model.ground_truth``, as verl's files have).
Every other field is kept in :attr:`PromptRow.metadata` (e.g. ``num_people``, used to
report K&K accuracy per N).

A bad row raises :class:`DataError` naming the file, the row (1-based: the line number
in a ``.jsonl`` file, the record number in a ``.parquet`` file) and the field: bytes that
are not UTF-8, invalid JSON, a row that is not an object, a missing or null field, a
prompt that is not a non-empty string, a NUL byte, a ground truth holding NaN or an
infinity (JSON's ``NaN``/``Infinity`` literals). A file without any row is an error too.
A UTF-8 byte-order mark is dropped; blank lines in ``.jsonl`` are skipped (and still
counted for row numbers; their count goes to the log). :func:`duplicate_ids` finds rows
sharing an ``id`` (the trainer warns about them: a repeated row is weighted twice).

Parquet needs ``pyarrow``, which is optional: reading a ``.parquet`` file without it is
an error that says how to install it; :func:`parquet_available` tells writers.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_log = logging.getLogger(__name__)

_MISSING = object()


class DataError(ValueError):
    """A bad data file or row; ``file``, ``row`` (1-based, or None) and ``field`` say where."""

    def __init__(self, message: str, *, file: str | os.PathLike, row: int | None = None, field: str | None = None):
        self.file, self.row, self.field = str(file), row, field
        where = self.file + (f", row {row}" if row is not None else "") + (f", field {field!r}" if field else "")
        super().__init__(f"{where}: {message}")


@dataclass(kw_only=True, frozen=True)
class PromptRow:
    """One prompt of a dataset, with where it came from."""

    prompt: str
    """The prompt field (the question; templating happens later, see ``data.prompts``)."""

    ground_truth: Any
    """What the reward function compares against (any JSON value but null)."""

    file: str
    """The file the row was read from."""

    row: int
    """1-based line number (``.jsonl``) or record number (``.parquet``) in ``file``."""

    metadata: dict[str, Any] = field(default_factory=dict)
    """The row's other top-level fields (``id``, ``num_people``, ...)."""


def parquet_available() -> bool:
    """Whether ``pyarrow`` can be imported (needed for ``.parquet`` files)."""
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        return False
    return True


def _lookup(obj: dict[str, Any], key: str) -> Any:
    """``obj[key]``, else the dotted path ``a.b.c`` into nested dicts; ``_MISSING`` if absent."""
    if key in obj:
        return obj[key]
    value: Any = obj
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def iter_jsonl_records(path: str | os.PathLike) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` for each non-blank line; :class:`DataError` on bytes that are
    not UTF-8, a NUL byte (a binary or truncated-and-padded file), or bad JSON. A UTF-8
    byte-order mark at the start is dropped; blank lines are skipped and counted in the log."""
    blank = 0
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            nul = raw.find(b"\x00")
            if nul >= 0:
                raise DataError(f"holds a NUL byte at byte {nul + 1} of the line (a binary or damaged file?)",
                                file=path, row=line_no)  # fmt: skip
            try:
                line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise DataError(
                    f"not valid UTF-8: byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the line",
                    file=path,
                    row=line_no,
                ) from None
            if not line.strip():
                blank += 1
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"invalid JSON: {e.msg} at column {e.colno}", file=path, row=line_no) from None
            if not isinstance(obj, dict):
                raise DataError(f"expected a JSON object, got {type(obj).__name__}", file=path, row=line_no)
            yield line_no, obj
    if blank:
        _log.info("%s: %d blank line(s) skipped", path, blank)


def _non_finite(value: Any) -> bool:
    """Whether ``value`` (a JSON value) holds a NaN or an infinity anywhere."""
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(_non_finite(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_non_finite(v) for v in value)
    return False


def iter_parquet_records(path: str | os.PathLike) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(record number, object)`` for each record of a parquet file (needs pyarrow)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError("reading .parquet needs pyarrow (pip install pyarrow), or use .jsonl", file=path) from None
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for a corrupt or non-parquet file
        raise DataError(f"cannot read parquet: {type(e).__name__}: {e}", file=path) from None
    yield from enumerate(table.to_pylist(), 1)


def iter_records(path: str | os.PathLike) -> Iterator[tuple[int, dict[str, Any]]]:
    """Raw records of a ``.jsonl`` or ``.parquet`` file, with 1-based row numbers."""
    path = Path(path)
    if not path.is_file():
        # A directory (or a FIFO, a device) is named as what it is: "no such file" would
        # send the user looking for a file that is there.
        raise DataError("no such file" if not path.exists() else "not a regular file (a directory?)", file=path)
    if path.suffix == ".jsonl":
        return iter_jsonl_records(path)
    if path.suffix == ".parquet":
        return iter_parquet_records(path)
    raise DataError(f"unsupported file type {path.suffix!r}; expected .jsonl or .parquet", file=path)


def load_rows(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    prompt_key: str = "prompt",
    ground_truth_key: str = "ground_truth",
) -> list[PromptRow]:
    """All rows of the files, in order, checked (see the module doc for what a bad row is)."""

    def row(path: str | os.PathLike, row_no: int, record: dict[str, Any]) -> PromptRow:
        prompt = _text(record, prompt_key, "prompt", path, row_no)
        truth = _lookup(record, ground_truth_key)
        if truth is _MISSING or truth is None:
            state = "missing" if truth is _MISSING else "null"
            raise DataError(f"ground truth is {state}", file=path, row=row_no, field=ground_truth_key)
        if _non_finite(truth):  # JSON's NaN/Infinity literals: no reward can compare against them
            raise DataError("ground truth holds NaN or an infinity", file=path, row=row_no, field=ground_truth_key)
        metadata = {k: v for k, v in record.items() if k not in (prompt_key, ground_truth_key)}
        return PromptRow(prompt=prompt, ground_truth=truth, file=str(path), row=row_no, metadata=metadata)

    return _read_rows(paths, row)


def _read_rows(paths: str | os.PathLike | Sequence[str | os.PathLike], make_row) -> list:
    """``make_row(path, row number, record)`` of every record of the files, in order; a file
    without any row is an error."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    rows = []
    for path in paths:
        before = len(rows)
        rows += [make_row(path, row_no, record) for row_no, record in iter_records(path)]
        if len(rows) == before:
            raise DataError("the file holds no rows", file=path)
    return rows


def _text(record: dict[str, Any], key: str, what: str, path: str | os.PathLike, row_no: int) -> str:
    """The non-empty string field ``key`` of a row (``what`` names it in errors)."""
    value = _lookup(record, key)
    if value is _MISSING or value is None:
        raise DataError(f"{what} is {'missing' if value is _MISSING else 'null'}", file=path, row=row_no, field=key)
    if not isinstance(value, str):
        raise DataError(f"{what} must be a string, got {type(value).__name__}", file=path, row=row_no, field=key)
    if not value.strip():
        raise DataError(f"{what} is empty", file=path, row=row_no, field=key)
    if "\x00" in value:
        raise DataError(f"{what} holds a NUL character", file=path, row=row_no, field=key)
    return value


@dataclass(kw_only=True, frozen=True)
class SFTRow:
    """One prompt/response row of a supervised fine-tuning set."""

    prompt: str
    """The prompt field (templated later, as an RL run's prompts are: ``data.prompts``)."""

    response: str
    """The response field: the text the model learns to continue the rendered prompt with."""

    file: str
    """The file the row was read from."""

    row: int
    """1-based row number in that file."""


def load_sft_rows(
    paths: str | os.PathLike | Sequence[str | os.PathLike], *, prompt_key: str = "prompt", response_key: str = "response"
) -> list[SFTRow]:
    """All prompt/response rows of the files, in order, checked as :func:`load_rows` checks
    a prompt (both fields non-empty strings without NUL)."""

    def row(path: str | os.PathLike, row_no: int, record: dict[str, Any]) -> SFTRow:
        prompt = _text(record, prompt_key, "prompt", path, row_no)
        response = _text(record, response_key, "response", path, row_no)
        return SFTRow(prompt=prompt, response=response, file=str(path), row=row_no)

    return _read_rows(paths, row)


def duplicate_ids(
    rows: Sequence[PromptRow], *, key: str = "id", earlier: Sequence[PromptRow] = ()
) -> list[tuple[PromptRow, PromptRow]]:
    """``(first row, repeating row)`` for every row of ``rows`` whose ``key`` field repeats the
    one of an earlier row of ``rows`` or of ``earlier`` (e.g. eval rows against the training
    rows); rows without the field are not compared."""
    first: dict[str, PromptRow] = {}
    repeats = []
    for is_new, row in [(False, r) for r in earlier] + [(True, r) for r in rows]:
        value = row.metadata.get(key)
        if value is None:
            continue
        marker = json.dumps(value, sort_keys=True)  # ids may be numbers or strings; 1 and "1" differ
        if marker not in first:
            first[marker] = row
        elif is_new:
            repeats.append((first[marker], row))
    return repeats


# --------------------------------------------------------------------------- writing


def _atomic_write(path: Path, write) -> None:
    """Write through a temporary file in the same directory, then rename (no half files)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_jsonl(path: str | os.PathLike, rows: Iterable[dict[str, Any]]) -> Path:
    """One JSON object per line (UTF-8, non-ASCII kept as is)."""
    path = Path(path)

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")

    _atomic_write(path, write)
    return path


def write_parquet(path: str | os.PathLike, rows: Sequence[dict[str, Any]]) -> Path:
    """The rows as a parquet table (needs pyarrow; nested fields become struct/list columns)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    table = pa.Table.from_pylist(list(rows))
    _atomic_write(path, lambda tmp: pq.write_table(table, tmp))
    return path
