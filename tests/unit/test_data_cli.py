"""``megatron-rl generate-data`` through its module's ``add_arguments`` / ``run``."""

from __future__ import annotations

import argparse
import json

import pytest

import megatron_rl.tasks  # noqa: F401  (registers the built-in rewards)
from megatron_rl.cli import generate_data as cli
from megatron_rl.data import load_rows, parquet_available
from megatron_rl.rewards import score_batch


def _run(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="megatron-rl generate-data")
    cli.add_arguments(parser)
    return cli.run(parser.parse_args(argv))


def test_kk_files_are_deterministic_and_loadable(tmp_path):
    args = ["kk", "--num-people", "3", "4", "--train-per-n", "20", "--test-per-n", "5", "--seed", "1"]
    args += ["--parquet", "no"]
    assert _run(*args, "--out", str(tmp_path / "a")) == 0
    assert _run(*args, "--out", str(tmp_path / "b")) == 0
    for rel in ("train.jsonl", "test.jsonl", "3ppl/train.jsonl", "4ppl/test.jsonl"):
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes()
    assert not list((tmp_path / "a").glob("*.parquet"))
    info = json.loads((tmp_path / "a" / "info.json").read_text())
    assert info["rows"] == {"train": 40, "test": 10} and info["arguments"]["num_people"] == [3, 4]

    rows = load_rows(tmp_path / "a" / "test.jsonl")
    assert [r.metadata["num_people"] for r in rows] == [3] * 5 + [4] * 5
    assert len(load_rows(tmp_path / "a" / "4ppl" / "train.jsonl")) == 20
    # the files' ground truth is what kk_logic scores
    answers = [f"ok</think><answer>{r.ground_truth['solution_text_format']}</answer>" for r in rows]
    scores, _ = score_batch("kk_logic", answers, [r.ground_truth for r in rows], prompts=["<think>"] * 10,
                            timeout_s=None)  # fmt: skip
    assert scores == [3.0] * 10


def test_toy_writes_prompts_and_tokenizer(tmp_path):
    assert _run("toy", "--num-train", "30", "--num-test", "10", "--num-digits", "2", "--out", str(tmp_path)) == 0
    rows = load_rows(tmp_path / "train.jsonl")
    assert len(rows) == 30 and rows[0].prompt.startswith("copy ") and len(rows[0].ground_truth.split()) == 2
    assert (tmp_path / "tokenizer" / "tokenizer.json").is_file()


def test_parquet_when_available(tmp_path):
    if not parquet_available():
        pytest.skip("pyarrow is not installed")
    assert _run("kk", "--num-people", "3", "--train-per-n", "5", "--test-per-n", "2", "--out", str(tmp_path)) == 0
    jsonl, parquet = load_rows(tmp_path / "train.jsonl"), load_rows(tmp_path / "train.parquet")
    assert [(r.prompt, r.ground_truth, r.metadata) for r in jsonl] == [
        (r.prompt, r.ground_truth, r.metadata) for r in parquet
    ]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["kk", "--num-people", "1"], "sizes must be in [2, 10]"),
        (["kk", "--num-people", "3", "3"], "has duplicates"),
        (["kk", "--train-per-n", "-1"], "--train-per-n must be >= 0"),
        (["kk", "--num-people", "2", "--train-per-n", "500"], "distinct 2-people puzzles"),
        (["toy", "--num-digits", "0"], "--num-digits must be >= 1"),
        (["toy", "--num-digits", "1", "--num-train", "20"], "only 10 distinct 1-digit targets"),
    ],
)
def test_usage_errors(tmp_path, capsys, argv, message):
    assert _run(*argv, "--out", str(tmp_path / "out")) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out" / "train.jsonl").exists()
