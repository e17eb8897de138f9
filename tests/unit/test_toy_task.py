"""The toy copy task: generator, dense reward, and the local word-level tokenizer."""

from __future__ import annotations

import random

import pytest

from megatron_rl.tasks import get_reward, toy
from megatron_rl.tasks.toy import toy_copy


def test_generator_rows_determinism_and_disjoint_splits():
    splits = toy.generate_splits(num_train=300, num_test=50, seed=3)
    assert splits == toy.generate_splits(num_train=300, num_test=50, seed=3)
    assert splits != toy.generate_splits(num_train=300, num_test=50, seed=4)
    row = splits["train"][0]
    assert set(row) == {"id", "prompt", "ground_truth", "num_digits", "split"}
    assert row["prompt"] == f"copy {row['ground_truth']} =" and len(row["ground_truth"].split()) == 3
    train = {r["ground_truth"] for r in splits["train"]}
    test = {r["ground_truth"] for r in splits["test"]}
    assert len(train) == 300 and len(test) == 50 and not train & test
    # the test split does not depend on the train size
    assert toy.generate_splits(num_train=10, num_test=50, seed=3)["test"] == splits["test"]
    with pytest.raises(ValueError, match="only 100 distinct 2-digit targets"):
        toy.generate_splits(num_train=90, num_test=20, num_digits=2)


@pytest.mark.parametrize(
    "response, score",
    [
        ("3 1 4", 1.0),  # every digit right, stopped
        ("3 1 4 <eos> 9 9", 1.0),  # tokens after <eos> do not count
        ("<pad> 3 1 4 <pad>", 1.0),
        ("3 1 4 4", 0.9),  # right digits, did not stop
        ("3 1 9", 0.6 + 0.1),
        ("3", 0.3),
        ("9 9 9", 0.1),
        ("", 0.0),
        ("copy copy copy copy", 0.0),
    ],
)
def test_reward_gives_partial_credit(response, score):
    result = toy_copy(response, "3 1 4")
    assert result.score == pytest.approx(score) and not result.parse_failed


def test_random_responses_already_earn_some_reward():
    # The property that lets RL start from a random init: uniform tokens score ~0.06 and
    # vary within a group, so group-normalised advantages are not all zero.
    rng = random.Random(0)
    scores = []
    for _ in range(4000):
        tokens = [rng.choice(toy.TOY_VOCAB) for _ in range(5)]
        scores.append(toy_copy(" ".join(tokens), "3 1 4").score)
    mean = sum(scores) / len(scores)
    assert 0.04 < mean < 0.1
    groups = [scores[i : i + 4] for i in range(0, len(scores), 4)]
    assert sum(len(set(g)) > 1 for g in groups) / len(groups) > 0.4


def test_reward_is_registered_and_rejects_bad_ground_truth():
    assert get_reward("toy_copy").fn is toy_copy
    with pytest.raises(ValueError, match="toy_copy ground truth"):
        toy_copy("1", "")


def test_tokenizer_round_trip(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = toy.build_toy_tokenizer()
    assert len(tokenizer) == len(toy.TOY_VOCAB) == 15
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
    ids = tokenizer("copy 3 1 4 =")["input_ids"]
    assert ids == [toy.TOY_VOCAB.index(t) for t in ("copy", "3", "1", "4", "=")]
    assert tokenizer.decode(ids) == "copy 3 1 4 ="
    response_ids = tokenizer("3 1 4")["input_ids"] + [tokenizer.eos_token_id]
    assert tokenizer.decode(response_ids, skip_special_tokens=True) == "3 1 4"
    assert toy_copy(tokenizer.decode(response_ids), "3 1 4").score == 1.0  # with or without special tokens
    assert tokenizer("copy x =")["input_ids"][1] == tokenizer.unk_token_id

    loaded = AutoTokenizer.from_pretrained(str(toy.save_toy_tokenizer(tmp_path / "tok")))
    assert (tmp_path / "tok" / "tokenizer.json").is_file()
    assert loaded("copy 3 1 4 =")["input_ids"] == ids
    assert (loaded.eos_token, loaded.pad_token) == ("<eos>", "<pad>")
    assert not loaded.chat_template
