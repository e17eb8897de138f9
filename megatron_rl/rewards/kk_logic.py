"""The Knights-and-Knaves reward of Logic-RL (format + answer), exactly as its code scores.

Follows ``verl/utils/reward_score/kk.py`` of Logic-RL as used by the AR/Lopti runs
(``docs/data_and_rewards.md`` walks through it):

- Format: +1 when ``<think>``, ``</think>``, ``<answer>``, ``</answer>`` each occur exactly
  once, in that order, in the assistant turn; else -1. The assistant turn is the
  pre-filled text of the prompt (``<think>`` for the K&K prompt) plus the response, so a
  pre-filled ``<think>`` counts and a second one in the response breaks the format.
  Tags are matched case-sensitively (``<Think>`` is not a tag).
- Answer, scored only when the format is right and the text between the answer tags is
  non-empty after stripping: +2 when every role is right, -1.5 when any is wrong, -2 when
  unparseable. Otherwise (format wrong, or empty answer) the answer part is -2.
- Unparseable: the number of occurrences of ``knight`` plus ``knave`` in the lower-cased
  answer (substrings, so ``knights`` counts) differs from the number of people, or some
  person has no ``<name> is a knight|knave`` (case-insensitive, whole words, any
  whitespace). The first such phrase per person is the prediction.
- Totals: 3 (right), -0.5 (wrong), -1 (format right, answer unparseable or empty),
  -3 (format wrong).

One deliberate departure that changes no score: the answer is the text between the two
(unique) answer tags, found with ``str.find``; Logic-RL runs a lazy ``.*?`` regex over the
whole response, which is quadratic on responses full of unmatched ``<answer>`` tags.
"""

from __future__ import annotations

import re
from typing import Any

from megatron_rl.rewards.registry import RewardResult, register_reward

THINK_OPEN, THINK_CLOSE, ANSWER_OPEN, ANSWER_CLOSE = "<think>", "</think>", "<answer>", "</answer>"
_TAGS = (THINK_OPEN, THINK_CLOSE, ANSWER_OPEN, ANSWER_CLOSE)
ROLES = ("knight", "knave")

FORMAT_OK, FORMAT_BAD = 1.0, -1.0
ANSWER_RIGHT, ANSWER_WRONG, ANSWER_UNPARSEABLE = 2.0, -1.5, -2.0
MAX_SCORE = FORMAT_OK + ANSWER_RIGHT
"""3.0: the score of a fully right response; K&K accuracy is the fraction scoring exactly this."""
MIN_SCORE = FORMAT_BAD + ANSWER_UNPARSEABLE
"""-3.0: format wrong; also this reward's ``failure_score``."""

# Logic-RL reads the ground-truth name as the first alphabetic word of each line of
# `solution_text_format` ("(1) Zoey is a knight" -> Zoey).
_GT_LINE = re.compile(r"\b([A-Za-z]+)\b.*?\b(knight|knave)\b", re.IGNORECASE)


def expected_roles(ground_truth: Any) -> dict[str, str]:
    """The solution as ``{name: "knight" | "knave"}`` from any accepted ground-truth form.

    Accepted: a dict with ``solution`` (a list of ``{"name", "role"}`` or a ``{name: role}``
    mapping; what ``megatron-rl generate-data kk`` writes), a dict with Logic-RL's
    ``solution_text_format`` (lines ``(1) Zoey is a knight``), or that text itself.
    """
    if isinstance(ground_truth, dict) and ground_truth.get("solution") is not None:
        solution = ground_truth["solution"]
        if isinstance(solution, dict):
            pairs = list(solution.items())
        elif isinstance(solution, list) and all(isinstance(x, dict) for x in solution):
            pairs = [(x.get("name"), x.get("role")) for x in solution]
        else:
            raise ValueError("kk_logic ground truth: 'solution' must be a list of {name, role} or a {name: role} map")
        roles = {}
        for name, role in pairs:
            if not isinstance(name, str) or not name or role not in ROLES:
                raise ValueError(f"kk_logic ground truth: bad solution entry {name!r} -> {role!r}")
            roles[name] = role
        return roles
    text = ground_truth.get("solution_text_format") if isinstance(ground_truth, dict) else ground_truth
    if not isinstance(text, str):
        raise ValueError(
            "kk_logic ground truth must be a dict with 'solution' or 'solution_text_format', or that text; "
            f"got {type(ground_truth).__name__}"
        )
    roles = {}
    for line in text.split("\n"):
        match = _GT_LINE.search(line.strip())
        if match:
            roles[match.group(1)] = match.group(2).lower()
    if not roles:
        raise ValueError(f"kk_logic ground truth: no '<name> ... knight|knave' line in {text[:200]!r}")
    return roles


def format_ok(assistant_text: str) -> bool:
    """Each of the four tags exactly once, in the order think, /think, answer, /answer."""
    if any(assistant_text.count(tag) != 1 for tag in _TAGS):
        return False
    positions = [assistant_text.find(tag) for tag in _TAGS]
    return positions == sorted(positions)


def parse_answer(answer_text: str, names: list[str]) -> dict[str, str] | None:
    """``{name: role}`` from the answer text, or ``None`` when it is unparseable (see module doc)."""
    lowered = answer_text.lower()
    if lowered.count("knight") + lowered.count("knave") != len(names):
        return None
    predicted = {}
    for name in names:
        match = re.search(rf"\b{re.escape(name)}\b\s+is\s+a\s+\b(knight|knave)\b", answer_text, re.IGNORECASE)
        if match is None:
            return None
        predicted[name] = match.group(1).lower()
    return predicted


def score_kk(response: str, ground_truth: Any, *, think_prefilled: bool) -> RewardResult:
    """Score one K&K response (the generated text only) against its solution.

    Args:
        response: the generated text, without the prompt.
        ground_truth: the row's ground truth (see :func:`expected_roles`).
        think_prefilled: whether the prompt ended with a pre-filled ``<think>``; it then
            counts as the response's opening tag.
    """
    solution = expected_roles(ground_truth)
    assistant_text = (THINK_OPEN if think_prefilled else "") + response
    if not format_ok(assistant_text):
        return RewardResult(
            score=FORMAT_BAD + ANSWER_UNPARSEABLE, parse_failed=True, extras={"format_ok": False, "answer": "skipped"}
        )
    start = assistant_text.find(ANSWER_OPEN) + len(ANSWER_OPEN)
    answer_text = assistant_text[start : assistant_text.find(ANSWER_CLOSE)].strip()
    predicted = parse_answer(answer_text, list(solution)) if answer_text else None
    if predicted is None:
        verdict, answer_score = ("unparseable" if answer_text else "empty"), ANSWER_UNPARSEABLE
    elif predicted == solution:
        verdict, answer_score = "right", ANSWER_RIGHT
    else:
        verdict, answer_score = "wrong", ANSWER_WRONG
    return RewardResult(
        score=FORMAT_OK + answer_score, parse_failed=predicted is None, extras={"format_ok": True, "answer": verdict}
    )


def prompt_prefills_think(prompt: str) -> bool:
    """Whether a rendered prompt ends with the ``<think>`` pre-fill (trailing whitespace ignored)."""
    return prompt.rstrip().endswith(THINK_OPEN)


@register_reward("kk_logic", failure_score=MIN_SCORE, success_score=MAX_SCORE)
def kk_logic(response: str, ground_truth: Any, *, prompt: str = "") -> RewardResult:
    """Logic-RL's K&K reward (totals 3 / -0.5 / -1 / -3); ``prompt`` tells whether ``<think>`` was pre-filled."""
    return score_kk(response, ground_truth, think_prefilled=prompt_prefills_think(prompt))
