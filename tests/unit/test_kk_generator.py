"""The K&K generator: unique solutions (re-checked by brute force), determinism, disjoint splits."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from megatron_rl.data.prompts import render_prompt
from megatron_rl.tasks import kk
from megatron_rl.tasks.kk import KK_STYLE, kk_logic

SIZES = [2, 3, 4, 5, 6, 7]


@pytest.fixture(scope="module")
def splits():
    return kk.generate_splits(SIZES, train_per_n=30, test_per_n=10, seed=0)


def _brute_force(statements, n):
    """Independent re-solve: a knight's statement is true, a knave's false."""
    return [a for a in itertools.product((True, False), repeat=n)
            if all(kk.evaluate(s, a) == k for s, k in zip(statements, a))]  # fmt: skip


def test_every_puzzle_has_a_unique_solution_matching_its_ground_truth(splits):
    for row in splits["train"] + splits["test"]:
        n = row["num_people"]
        statements = json.loads(row["statements"])
        (only,) = _brute_force(statements, n)  # exactly one consistent assignment
        solution = row["ground_truth"]["solution"]
        assert [s["role"] == "knight" for s in solution] == list(only)
        assert len({s["name"] for s in solution}) == n


def test_reward_scores_3_for_the_solution_in_the_expected_format(splits):
    for row in splits["test"]:
        prompt = render_prompt(row["prompt"], template="literal", style=KK_STYLE)
        answer = row["ground_truth"]["solution_text_format"]
        response = f"Let me check each statement.</think>\n<answer>\n{answer}\n</answer>"
        assert kk_logic(response, row["ground_truth"], prompt=prompt).score == 3.0
        flipped = answer.replace("knight", "KN").replace("knave", "knight").replace("KN", "knave")
        assert kk_logic(response.replace(answer, flipped), row["ground_truth"], prompt=prompt).score == -0.5


def test_counts_ids_and_fields(splits):
    assert len(splits["train"]) == 30 * len(SIZES) and len(splits["test"]) == 10 * len(SIZES)
    ids = [r["id"] for r in splits["train"] + splits["test"]]
    assert len(set(ids)) == len(ids)
    row = splits["test"][0]
    assert set(row) == {"id", "prompt", "ground_truth", "num_people", "split", "statements"}
    assert row["id"] == "kk_2ppl_test_00000" and row["split"] == "test"
    text = row["ground_truth"]["solution_text_format"].split("\n")
    assert [line.split()[0] for line in text] == ["(1)", "(2)"]
    json.dumps(splits)  # rows are plain JSON


def test_deterministic_by_seed():
    a = kk.generate_splits([3, 4], train_per_n=20, test_per_n=5, seed=7)
    assert a == kk.generate_splits([3, 4], train_per_n=20, test_per_n=5, seed=7)
    assert a != kk.generate_splits([3, 4], train_per_n=20, test_per_n=5, seed=8)
    # each N has its own stream: adding sizes or train rows does not change existing puzzles
    b = kk.generate_splits([4, 3, 5], train_per_n=30, test_per_n=5, seed=7)
    assert [r for r in b["test"] if r["num_people"] == 3] == [r for r in a["test"] if r["num_people"] == 3]
    assert [r for r in b["train"] if r["num_people"] == 4][:20] == [r for r in a["train"] if r["num_people"] == 4]


def test_splits_do_not_overlap_even_up_to_wording(splits):
    def key(row):
        names = [s["name"] for s in row["ground_truth"]["solution"]]
        puzzle = kk.Puzzle(names=tuple(names), statements=tuple(json.loads(row["statements"])), is_knight=())
        return row["num_people"], puzzle.key

    train = [key(r) for r in splits["train"]]
    test = [key(r) for r in splits["test"]]
    assert len(set(train)) == len(train) and len(set(test)) == len(test)
    assert not set(train) & set(test)
    assert not {r["prompt"] for r in splits["train"]} & {r["prompt"] for r in splits["test"]}


def test_key_identifies_logically_equal_puzzles():
    # "not a knight" == "a knave", operands swapped, other names: the same puzzle
    a_says = (["not", ["is", 1, "knight"]], ["and", ["is", 0, "knave"], ["is", 1, "knight"]])
    b_says = (["is", 1, "knave"], ["and", ["is", 1, "knight"], ["is", 0, "knave"]])
    a = kk.Puzzle(names=("A", "B"), statements=a_says, is_knight=())
    b = kk.Puzzle(names=("C", "D"), statements=b_says, is_knight=())
    assert a.key == b.key


@pytest.mark.parametrize(
    "op, truth",
    [("and", [1, 0, 0, 0]), ("or", [1, 1, 1, 0]), ("if", [1, 0, 1, 1]), ("iff", [1, 0, 0, 1])],
)
def test_operators(op, truth):
    statement = [op, ["is", 0, "knight"], ["is", 1, "knight"]]
    got = [kk.evaluate(statement, a) for a in itertools.product((True, False), repeat=2)]
    assert got == [bool(t) for t in truth]
    assert kk.evaluate(["not", ["is", 0, "knave"]], (True,)) is True


def test_question_text():
    puzzle = kk.Puzzle(names=("Zoey", "Oliver", "Ethan"), is_knight=(True, False, True),
                       statements=(["is", 2, "knight"], ["if", ["is", 0, "knight"], ["not", ["is", 2, "knight"]]],
                                   ["iff", ["is", 1, "knave"], ["is", 0, "knight"]]))  # fmt: skip
    text = puzzle.question()
    assert "You meet 3 inhabitants: Zoey, Oliver, and Ethan." in text
    assert 'Zoey says, "Ethan is a knight."' in text
    assert 'Oliver says, "If Zoey is a knight then Ethan is not a knight."' in text
    assert 'Ethan says, "Oliver is a knave if and only if Zoey is a knight."' in text
    assert text.endswith("So who is a knight and who is a knave?")
    assert puzzle.solution_text() == "(1) Zoey is a knight\n(2) Oliver is a knave\n(3) Ethan is a knight"
    assert kk.solutions(puzzle.statements) == [puzzle.is_knight]


def test_names_are_safe_for_the_answer_parser():
    assert len(set(kk.NAMES)) == len(kk.NAMES) >= kk.MAX_PEOPLE
    assert all(n.isalpha() and "knight" not in n.lower() and "knave" not in n.lower() for n in kk.NAMES)


def test_limits():
    with pytest.raises(ValueError, match="num_people"):
        kk.random_puzzle(random.Random(0), 1)
    with pytest.raises(RuntimeError, match="distinct 2-people puzzles"):
        kk.generate_splits([2], train_per_n=1000, test_per_n=0, seed=0)


@pytest.mark.parametrize("num_people", [2, 3, 5])
def test_sft_responses_are_worked_solutions_the_reward_scores_full(num_people):
    plain = kk.generate_splits([num_people], train_per_n=6, test_per_n=2, seed=3)
    sft = kk.generate_splits([num_people], train_per_n=6, test_per_n=2, seed=3, sft_responses=True)
    for split in ("train", "test"):
        assert [r["prompt"] for r in sft[split]] == [r["prompt"] for r in plain[split]]  # the same puzzles
        assert all("response" not in r for r in plain[split])
        for row in sft[split]:
            prompt = render_prompt(row["prompt"], template="literal", style=KK_STYLE)
            assert kk_logic(row["response"], row["ground_truth"], prompt=prompt).score == kk.MAX_SCORE
            cases = row["response"].split("</think>")[0].strip().split("Case: ")[1:]
            # The assignments in the solver's order, up to the solution (the last case).
            solution = tuple(s["role"] == "knight" for s in row["ground_truth"]["solution"])
            assert len(cases) == list(itertools.product((True, False), repeat=num_people)).index(solution) + 1
            fits = [case.splitlines()[0] for case in cases if case.rstrip().endswith("Every statement fits.")]
            assert fits == [", ".join(f"{s['name']} {s['role']}" for s in row["ground_truth"]["solution"]) + "."]
            for case in cases:
                said = case.splitlines()[1:]
                # A case checks statements in order up to the first that breaks it, or all of them.
                assert all(line.endswith(", fits.") for line in said[:-1])
                assert said[-1].endswith(", impossible.") or (
                    said[-1] == "Every statement fits." and len(said) == num_people + 1
                )


def test_the_trace_checks_each_claim_against_the_case():
    puzzle = kk.Puzzle(
        names=("Zoey", "Oliver"),
        statements=(["if", ["is", 0, "knight"], ["is", 1, "knave"]], ["not", ["is", 0, "knight"]]),
        is_knight=(True, False),
    )
    assert kk.solutions(puzzle.statements) == [(True, False)]
    assert kk.reasoning_trace(puzzle).splitlines() == [
        "Case: Zoey knight, Oliver knight.",
        "Zoey (knight) says If Zoey is a knight (yes) then Oliver is a knave (no): false, impossible.",
        "Case: Zoey knight, Oliver knave.",
        "Zoey (knight) says If Zoey is a knight (yes) then Oliver is a knave (yes): true, fits.",
        "Oliver (knave) says Zoey is not a knight (no): false, fits.",
        "Every statement fits.",
    ]  # the solution is unique: the cases after it are not tried


def test_the_cpu_tokenizer_round_trips_rows_exactly_and_is_deterministic(tmp_path):
    from transformers import AutoTokenizer

    from megatron_rl.cli import main
    from megatron_rl.data.prompts import PromptEncoder
    from megatron_rl.tasks.kk import KK_TOKENIZER_SPECIALS as SPECIAL_TOKENS

    args = ["generate-data", "kk", "--num-people", "2", "3", "--train-per-n", "20", "--test-per-n", "4",
            "--sft-responses", "--tokenizer", "--parquet", "no"]  # fmt: skip
    assert main([*args, "--out", str(tmp_path / "a")]) == 0 and main([*args, "--out", str(tmp_path / "b")]) == 0
    assert (tmp_path / "a" / "tokenizer" / "tokenizer.json").read_bytes() == (
        tmp_path / "b" / "tokenizer" / "tokenizer.json"
    ).read_bytes()
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "a" / "tokenizer"))
    assert tok.eos_token_id == tok.pad_token_id == 0
    tags = ["<think>", "</think>", "<answer>", "</answer>"]
    assert [tok.convert_tokens_to_ids(t) for t in [*SPECIAL_TOKENS, *tags]] == list(range(7))
    assert tok.decode(list(range(7)), skip_special_tokens=True) == "".join(tags)  # the tags are kept
    for line in (tmp_path / "a" / "test.jsonl").read_text().splitlines():  # rows it was not trained on
        row = json.loads(line)
        prompt = render_prompt(row["prompt"], template="literal", style=KK_STYLE)
        for text in (prompt, row["response"]):
            ids = tok.encode(text, add_special_tokens=False)
            assert tok.decode(ids) == text
        assert tok.encode("<think>", add_special_tokens=False) == [tok.convert_tokens_to_ids("<think>")]
        # what the trainer scores: the generated ids (the response, then EOS) decoded as the
        # run decodes them keep the tags, and the worked solution scores the full 3.0
        generated = tok.encode(row["response"], add_special_tokens=False) + [tok.eos_token_id]
        decoded = PromptEncoder(tok, template="literal", style=KK_STYLE, max_prompt_tokens=4096).decode(generated)
        assert decoded == row["response"]
        assert kk_logic(decoded, row["ground_truth"], prompt=prompt).score == 3.0
    assert main([*args, "--out", str(tmp_path / "c"), "--tokenizer-vocab-size", "100"]) == 2
