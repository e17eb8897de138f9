"""Dataset loading: good rows, and bad rows whose errors name the file, the row and the field."""

from __future__ import annotations

import json

import pytest

from megatron_rl.data import DataError, load_rows, parquet_available, write_jsonl, write_parquet

GOOD = {"id": "a", "prompt": "Who?", "ground_truth": {"answer": "me"}, "num_people": 3}


def _jsonl(path, *lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_loads_rows_with_metadata_and_line_numbers(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", json.dumps(GOOD), "", "  ", json.dumps({**GOOD, "id": "b"}))
    rows = load_rows(str(path))
    assert [(r.row, r.metadata["id"]) for r in rows] == [(1, "a"), (4, "b")]  # blank lines counted, skipped
    assert rows[0].prompt == "Who?" and rows[0].ground_truth == {"answer": "me"} and rows[0].file == str(path)
    assert rows[0].metadata == {"id": "a", "num_people": 3}


def test_several_files_in_order(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [GOOD])
    b = write_jsonl(tmp_path / "b.jsonl", [{**GOOD, "id": "b"}])
    assert [r.metadata["id"] for r in load_rows([a, b])] == ["a", "b"]


def test_configurable_and_dotted_keys(tmp_path):
    row = {"question": "Q", "reward_model": {"ground_truth": "7"}}
    path = write_jsonl(tmp_path / "verl.jsonl", [row])
    (loaded,) = load_rows(path, prompt_key="question", ground_truth_key="reward_model.ground_truth")
    assert loaded.prompt == "Q" and loaded.ground_truth == "7"


BAD_ROWS = [
    ("invalid_json", '{"prompt": "Q", "ground_truth": ', None, "invalid JSON"),
    ("not_an_object", '["Q", "A"]', None, "expected a JSON object, got list"),
    ("missing_prompt", '{"ground_truth": "A"}', "prompt", "prompt is missing"),
    ("null_prompt", '{"prompt": null, "ground_truth": "A"}', "prompt", "prompt is null"),
    ("prompt_wrong_type", '{"prompt": ["Q"], "ground_truth": "A"}', "prompt", "prompt must be a string, got list"),
    ("empty_prompt", '{"prompt": "  ", "ground_truth": "A"}', "prompt", "prompt is empty"),
    ("missing_ground_truth", '{"prompt": "Q"}', "ground_truth", "ground truth is missing"),
    ("null_ground_truth", '{"prompt": "Q", "ground_truth": null}', "ground_truth", "ground truth is null"),
]


@pytest.mark.parametrize("line, field, message", [c[1:] for c in BAD_ROWS], ids=[c[0] for c in BAD_ROWS])
def test_bad_row_errors_name_file_row_and_field(tmp_path, line, field, message):
    path = _jsonl(tmp_path / "bad.jsonl", json.dumps(GOOD), "", line)
    with pytest.raises(DataError) as err:
        load_rows(path)
    e = err.value
    assert (e.file, e.row, e.field) == (str(path), 3, field)
    expected_where = f"{path}, row 3" + (f", field {field!r}" if field else "")
    assert str(e).startswith(expected_where + ": ") and message in str(e)


def test_custom_key_is_named_in_the_error(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "Q", "solution": 1}, {"question": "Q"}])
    with pytest.raises(DataError, match=r"d\.jsonl, row 2, field 'solution': ground truth is missing"):
        load_rows(path, prompt_key="question", ground_truth_key="solution")


@pytest.mark.parametrize(
    "name, message",
    [("missing.jsonl", "no such file"), ("data.csv", "unsupported file type"), ("dir.jsonl", "not a regular file")],
)
def test_file_errors(tmp_path, name, message):
    if name.endswith(".csv"):
        (tmp_path / name).write_text("a,b\n")
    if name.startswith("dir"):
        (tmp_path / name).mkdir()
    with pytest.raises(DataError, match=message) as err:
        load_rows(tmp_path / name)
    assert err.value.file == str(tmp_path / name) and err.value.row is None


def test_parquet_round_trip_and_bad_row(tmp_path):
    if not parquet_available():
        pytest.skip("pyarrow is not installed")
    rows = [GOOD, {**GOOD, "id": "b", "ground_truth": {"answer": "you"}}]
    loaded = load_rows(write_parquet(tmp_path / "d.parquet", rows))
    assert [(r.row, r.prompt, r.ground_truth, r.metadata) for r in loaded] == [
        (1, "Who?", {"answer": "me"}, {"id": "a", "num_people": 3}),
        (2, "Who?", {"answer": "you"}, {"id": "b", "num_people": 3}),
    ]
    bad_rows = [{"prompt": "Q", "ground_truth": "A"}, {"prompt": None, "ground_truth": "A"}]
    bad = write_parquet(tmp_path / "bad.parquet", bad_rows)
    with pytest.raises(DataError, match=r"bad\.parquet, row 2, field 'prompt': prompt is null"):
        load_rows(bad)
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(DataError, match="cannot read parquet"):
        load_rows(tmp_path / "junk.parquet")


# --------------------------------------------------------------------------- reliability


def test_bytes_that_are_not_utf8_name_file_and_row(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n" + b'{"prompt": "caf\xe9", "ground_truth": "A"}\n')
    with pytest.raises(DataError) as err:
        load_rows(path)
    assert (err.value.file, err.value.row) == (str(path), 2) and "not valid UTF-8: byte 0xe9" in str(err.value)


def test_a_utf8_byte_order_mark_is_accepted(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(GOOD).encode() + b"\n")
    assert load_rows(path)[0].prompt == "Who?"


@pytest.mark.parametrize(
    "raw, row, field, message",
    [
        (b'{"prompt": "Who?", "ground_truth": NaN}', 2, "ground_truth", "ground truth holds NaN or an infinity"),
        (b'{"prompt": "Who?", "ground_truth": {"a": [1, -Infinity]}}', 2, "ground_truth", "NaN or an infinity"),
        (b'{"prompt": "Who?\x00", "ground_truth": "A"}', 2, None, "holds a NUL byte at byte 17 of the line"),
        (b'{"prompt": "Who?\\u0000", "ground_truth": "A"}', 2, "prompt", "prompt holds a NUL character"),
    ],
    ids=["nan_truth", "nested_infinity", "nul_byte", "nul_escape"],
)
def test_nul_bytes_and_non_finite_ground_truths_are_refused_naming_file_and_row(tmp_path, raw, row, field, message):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n" + raw + b"\n")
    with pytest.raises(DataError, match=message) as err:
        load_rows(path)
    assert (err.value.file, err.value.row, err.value.field) == (str(path), row, field)


def test_blank_lines_are_skipped_and_counted_in_the_log(tmp_path, caplog):
    path = _jsonl(tmp_path / "gaps.jsonl", json.dumps(GOOD), "", "   ", json.dumps({**GOOD, "id": "b"}))
    with caplog.at_level("INFO", logger="megatron_rl.data.loaders"):
        rows = load_rows(path)
    assert [r.row for r in rows] == [1, 4]  # row numbers stay line numbers
    assert f"{path}: 2 blank line(s) skipped" in caplog.text


@pytest.mark.parametrize("content", ["", "\n  \n"], ids=["empty", "blank_lines"])
def test_a_file_without_rows_is_an_error_naming_it(tmp_path, content):
    good = write_jsonl(tmp_path / "good.jsonl", [GOOD])
    empty = tmp_path / "empty.jsonl"
    empty.write_text(content)
    with pytest.raises(DataError, match="the file holds no rows") as err:
        load_rows([good, empty])
    assert err.value.file == str(empty)


def test_duplicate_ids_are_found_within_and_across_row_lists(tmp_path):
    from megatron_rl.data import duplicate_ids

    train = load_rows(write_jsonl(tmp_path / "t.jsonl", [GOOD, {**GOOD, "id": "b"}, GOOD, {**GOOD, "id": 1}]))
    assert [(a.row, b.row) for a, b in duplicate_ids(train)] == [(1, 3)]
    evals = load_rows(write_jsonl(tmp_path / "e.jsonl", [{**GOOD, "id": "b"}, {**GOOD, "id": "1"}]))
    assert [(a.file, a.row, b.row) for a, b in duplicate_ids(evals, earlier=train)] == [
        (str(tmp_path / "t.jsonl"), 2, 1)
    ]
