"""Every branch of the Logic-RL K&K reward (totals 3 / -0.5 / -1 / -3) and its edge cases."""

from __future__ import annotations

import pytest

from megatron_rl.data.prompts import render_prompt
from megatron_rl.tasks import get_reward
from megatron_rl.tasks.kk import (
    KK_STYLE,
    MAX_SCORE,
    MIN_SCORE,
    assistant_turn,
    expected_roles,
    kk_logic,
    score_assistant_turn,
    score_kk,
)

GT = {
    "solution": [
        {"name": "Zoey", "role": "knight"},
        {"name": "Oliver", "role": "knave"},
        {"name": "Ethan", "role": "knight"},
    ],
    "solution_text_format": "(1) Zoey is a knight\n(2) Oliver is a knave\n(3) Ethan is a knight",
}
RIGHT = "(1) Zoey is a knight\n(2) Oliver is a knave\n(3) Ethan is a knight"
WRONG = "(1) Zoey is a knight\n(2) Oliver is a knight\n(3) Ethan is a knight"


def _resp(answer: str, *, think: str = "Oliver contradicts Zoey.") -> str:
    """A response continuing a pre-filled ``<think>``."""
    return f"{think}</think>\n<answer>\n{answer}\n</answer>"


# (id, response, think pre-filled, expected total)
CASES = [
    ("right", _resp(RIGHT), True, 3.0),
    ("wrong_role", _resp(WRONG), True, -0.5),
    ("all_wrong", _resp(RIGHT.replace("knight", "X").replace("knave", "knight").replace("X", "knave")), True, -0.5),
    ("name_missing", _resp(RIGHT.replace("Ethan", "Mia")), True, -1.0),
    ("extra_person", _resp(RIGHT + "\n(4) Mia is a knave"), True, -1.0),
    ("too_few_roles", _resp("(1) Zoey is a knight\n(2) Oliver is a knave"), True, -1.0),
    ("plural_counts_as_mention", _resp(RIGHT + "\nSo two knights."), True, -1.0),
    ("negated_phrase_unparseable", _resp(RIGHT.replace("Oliver is a knave", "Oliver is not a knight")), True, -1.0),
    ("empty_answer", "thinking</think><answer>  \n </answer>", True, -1.0),
    ("no_tags_at_all", "Zoey is a knight, Oliver is a knave, Ethan is a knight", True, -3.0),
    ("missing_answer_tags", "thinking</think> (1) Zoey is a knight", True, -3.0),
    ("missing_close_answer", "thinking</think><answer>" + RIGHT, True, -3.0),
    ("duplicate_close_think", "a</think>b</think><answer>" + RIGHT + "</answer>", True, -3.0),
    ("duplicate_answer_block", _resp(RIGHT) + "<answer>" + RIGHT + "</answer>", True, -3.0),
    ("second_think_after_prefill", "<think>again</think><answer>" + RIGHT + "</answer>", True, -3.0),
    ("answer_before_think_close", "<answer>" + RIGHT + "</answer></think>", True, -3.0),
    ("not_prefilled_with_own_think", "<think>hmm</think><answer>" + RIGHT + "</answer>", False, 3.0),
    ("not_prefilled_without_think", "hmm</think><answer>" + RIGHT + "</answer>", False, -3.0),
    ("tags_are_case_sensitive", "hmm</THINK><answer>" + RIGHT + "</answer>", True, -3.0),
    ("names_and_roles_case_insensitive", _resp(RIGHT.upper()), True, 3.0),
    ("free_form_answer", _resp("Zoey is a knight, Oliver is a knave, and Ethan is a knight."), True, 3.0),
    ("any_whitespace_between_words", _resp("Zoey  is\na knight; Oliver is a\tknave; Ethan is a knight"), True, 3.0),
    ("order_of_people_irrelevant", _resp("Ethan is a knight\nOliver is a knave\nZoey is a knight"), True, 3.0),
    ("text_outside_answer_ignored", _resp(RIGHT) + "\nactually Oliver is a knight", True, 3.0),
    ("whole_word_names", _resp(RIGHT.replace("Zoey is", "Zoeyx is")), True, -1.0),
]


@pytest.mark.parametrize("response, prefilled, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_kk_reward_table(response, prefilled, expected):
    result = score_kk(response, GT, think_prefilled=prefilled)
    assert result.score == expected
    # the answer could not be used exactly when the total is -1 or -3
    assert result.parse_failed == (expected in (-1.0, -3.0))
    assert result.extras["format_ok"] == (expected != -3.0)


def test_the_four_totals_and_bounds():
    totals = {score_kk(c[1], GT, think_prefilled=c[2]).score for c in CASES}
    assert totals == {3.0, -0.5, -1.0, -3.0}
    assert (MAX_SCORE, MIN_SCORE) == (3.0, -3.0)
    assert get_reward("kk_logic").failure_score == MIN_SCORE


@pytest.mark.parametrize(
    "ground_truth",
    [
        GT,
        {"solution": {"Zoey": "knight", "Oliver": "knave", "Ethan": "knight"}},
        {"solution_text_format": GT["solution_text_format"]},  # Logic-RL's own ground-truth field
        GT["solution_text_format"],
    ],
    ids=["generated", "mapping", "logic_rl_dict", "text"],
)
def test_ground_truth_forms(ground_truth):
    assert expected_roles(ground_truth) == {"Zoey": "knight", "Oliver": "knave", "Ethan": "knight"}
    assert score_kk(_resp(RIGHT), ground_truth, think_prefilled=True).score == 3.0


@pytest.mark.parametrize("bad", [None, 3, {"solution": "Zoey"}, {"solution": [{"name": "Zoey", "role": "king"}]}, ""])
def test_bad_ground_truth_raises(bad):
    with pytest.raises(ValueError, match="kk_logic ground truth"):
        expected_roles(bad)


def test_registered_function_reads_prefill_from_the_prompt():
    prompt = render_prompt("Who is who?", template="literal", style=KK_STYLE)
    assert prompt.endswith("<|im_start|>assistant\n<think>")
    assert kk_logic(_resp(RIGHT), GT, prompt=prompt).score == 3.0
    # the same response after a prompt without the pre-fill lacks its <think>
    assert kk_logic(_resp(RIGHT), GT, prompt="Who is who?").score == -3.0
    assert kk_logic("<think>x" + _resp(RIGHT), GT, prompt="Who is who?").score == 3.0


# --------------------------------------------------------------------------- the checked text
# Logic-RL's `extract_solution` (verl/utils/reward_score/kk.py), restated as the
# independent reference: it decodes prompt + response and keeps what follows the first
# "Assistant:", else the first "<|im_start|>assistant", else the whole string.
def _logic_rl_processed_str(solution_str: str) -> str:
    if "Assistant:" in solution_str:
        return solution_str.split("Assistant:", 1)[1]
    if "<|im_start|>assistant" in solution_str:
        return solution_str.split("<|im_start|>assistant", 1)[1]
    return solution_str


CHAT = render_prompt("Who is who?", template="literal", style=KK_STYLE)  # ends "<|im_start|>assistant\n<think>"
BASE = "A conversation between User and Assistant. User: Who is who? Assistant: <think>"

# (id, prompt, response, expected total): prompts WITH an assistant header
TURN_CASES = [
    ("chat_prefill", CHAT, _resp(RIGHT), 3.0),
    ("chat_prefill_wrong", CHAT, _resp(WRONG), -0.5),
    ("chat_second_think_in_response", CHAT, "<think>" + _resp(RIGHT), -3.0),
    ("base_prefill", BASE, _resp(RIGHT), 3.0),
    # a pre-fill that continues past <think>: the checked text holds it, wherever <think> is
    ("chat_prefill_past_think", CHAT + " Let me see.", _resp(RIGHT), 3.0),
    ("base_prefill_past_think", BASE + " Let me see.\n", _resp(RIGHT), 3.0),
    ("prefill_holds_think_close", CHAT + "x</think>", "<answer>" + RIGHT + "</answer>", 3.0),
    ("prefill_without_think", render_prompt("Who is who?", template="literal"), _resp(RIGHT), -3.0),
    ("no_prefill_own_think", render_prompt("Who is who?", template="literal"), "<think>" + _resp(RIGHT), 3.0),
    # a second "Assistant:" in the response: the FIRST header (the prompt's) decides
    ("base_second_header_in_response", BASE, _resp(RIGHT) + "\nAssistant: <think>again", -3.0),
    ("base_second_header_harmless", BASE, _resp(RIGHT) + "\nAssistant: done", 3.0),
    # "Assistant:" is looked for before the chat header, even when only the response has it
    ("chat_then_assistant_colon_in_response", CHAT, "x</think>Assistant: <think>y" + _resp(RIGHT, think=""), 3.0),
    ("chat_then_assistant_colon_breaks", CHAT, _resp(RIGHT) + " Assistant: bye", -3.0),
]


@pytest.mark.parametrize("prompt, response, expected", [c[1:] for c in TURN_CASES], ids=[c[0] for c in TURN_CASES])
def test_assistant_turn_of_prompt_plus_response(prompt, response, expected):
    assert assistant_turn(prompt, response) == _logic_rl_processed_str(prompt + response)
    assert kk_logic(response, GT, prompt=prompt).score == expected
    assert score_assistant_turn(_logic_rl_processed_str(prompt + response), GT).score == expected


# (id, prompt, response, expected total): prompts WITHOUT an assistant header keep the
# response-only scoring (the pre-filled <think> read from the prompt's end)
NO_HEADER_CASES = [
    ("bare_question", "Who is who?", _resp(RIGHT), -3.0),
    ("bare_question_own_think", "Who is who?", "<think>x" + _resp(RIGHT), 3.0),
    ("bare_prefilled_think", "Who is who? <think>", _resp(RIGHT), 3.0),
    ("bare_prefilled_think_trailing_space", "Who is who?\n<think>\n", _resp(RIGHT), 3.0),
    ("empty_prompt", "", "<think>x" + _resp(RIGHT), 3.0),
    ("header_only_in_response_is_ignored", "Who is who? <think>", _resp(RIGHT) + " Assistant: done", 3.0),
]


@pytest.mark.parametrize(
    "prompt, response, expected", [c[1:] for c in NO_HEADER_CASES], ids=[c[0] for c in NO_HEADER_CASES]
)
def test_prompt_without_header_scores_the_response(prompt, response, expected):
    assert assistant_turn(prompt, response) is None
    assert kk_logic(response, GT, prompt=prompt).score == expected
    assert (
        kk_logic(response, GT, prompt=prompt).score
        == score_kk(response, GT, think_prefilled=prompt.rstrip().endswith("<think>")).score
    )
