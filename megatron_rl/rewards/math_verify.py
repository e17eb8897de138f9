"""math-verify on the last ``\\boxed{}`` of a response: the scoring behind the ``math`` task.

The ``math`` task (:mod:`megatron_rl.tasks.math`) registers :func:`score_math` as its
reward; this module registers nothing, so it can be used on its own.

- The answer is the content of the LAST ``\\boxed{...}`` in the response whose braces
  balance (nested braces are fine; a truncated final box falls back to the one before).
  No box, an empty box, or a box longer than :data:`MAX_ANSWER_CHARS` is a parse failure.
- Prediction and ground truth are both parsed by ``math_verify.parse`` as
  ``\\boxed{<text>}`` with LaTeX extraction (boxed first) and plain-expression fallback,
  then compared with ``math_verify.verify(gold, prediction)`` (numeric tolerance,
  symbolic equality, sets, intervals, ...). So ``\\boxed{1/2}`` matches ``0.5``.
- Reward 1.0 when verified, 0.0 otherwise; parse failures and time-outs also score 0.0.
- Time limits: math-verify's own per-call limits (``signal.alarm``, whole seconds) are
  used when this runs in a main thread (as in a :class:`~megatron_rl.rewards.pool.RewardPool`
  worker); they cannot work elsewhere, where the pool's hard per-sample limit (which
  kills the worker) is the only one. A math-verify time-out is reported as ``timed_out``.

The ground truth is a string or number (or a dict with an ``answer`` entry); a ground
truth that itself contains ``\\boxed{}`` is reduced to the last box's content.
"""

from __future__ import annotations

import threading
from typing import Any

from megatron_rl.rewards.registry import RewardResult

MAX_ANSWER_CHARS = 1000
"""Longest boxed answer parsed; longer ones are parse failures (sympy time grows fast)."""

PARSE_TIMEOUT_S = 2
"""math-verify's limit per ``parse`` call, in whole seconds (main thread only)."""

VERIFY_TIMEOUT_S = 2
"""math-verify's limit per comparison inside ``verify``, in whole seconds (main thread only)."""

_BOXED = "\\boxed"


def _brace_partners(text: str) -> dict[int, int]:
    """Position of each ``{`` -> position of its matching ``}``, in one linear pass.

    A backslash escapes the next character, so ``\\{`` and ``\\}`` are not delimiters.
    """
    open_positions: list[int] = []
    partners: dict[int, int] = {}
    i = 0
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            open_positions.append(i)
        elif c == "}" and open_positions:
            partners[open_positions.pop()] = i
        i += 1
    return partners


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` whose braces balance, or ``None``.

    Linear in the text, however many unbalanced boxes it has (a quadratic scan would let
    a response of thousands of ``\\boxed{`` stall scoring). ``\\boxed{\\{1,2\\}}`` gives
    ``\\{1,2\\}``.
    """
    if _BOXED not in text:
        return None
    partners = _brace_partners(text)
    end = len(text)
    while (start := text.rfind(_BOXED, 0, end)) != -1:
        i = start + len(_BOXED)
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{" and i in partners:
            return text[i + 1 : partners[i]]
        end = start  # unbalanced or not followed by '{': try the previous box
    return None


def _extraction_config() -> list[Any]:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    return [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]


def _gold_text(ground_truth: Any) -> str:
    if isinstance(ground_truth, dict):
        if "answer" not in ground_truth:
            raise ValueError("math ground truth dict needs an 'answer' entry")
        ground_truth = ground_truth["answer"]
    if isinstance(ground_truth, bool) or not isinstance(ground_truth, (str, int, float)):
        raise ValueError(f"math ground truth must be a string or number, got {type(ground_truth).__name__}")
    text = str(ground_truth).strip()
    boxed = last_boxed(text) if _BOXED in text else None
    return (boxed if boxed is not None else text).strip()


def score_math(response: str, ground_truth: Any) -> RewardResult:
    """1.0 if the last boxed answer of ``response`` equals ``ground_truth`` per math-verify, else 0.0."""
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException

    # signal.alarm only works in the main thread; elsewhere the pool's limit must do.
    in_main = threading.current_thread() is threading.main_thread()
    parse_timeout = PARSE_TIMEOUT_S if in_main else None
    verify_timeout = VERIFY_TIMEOUT_S if in_main else None
    config = _extraction_config()

    answer = last_boxed(response)
    if answer is None or not answer.strip() or len(answer) > MAX_ANSWER_CHARS:
        reason = "no boxed answer" if answer is None else ("empty" if not answer.strip() else "too long")
        return RewardResult(score=0.0, parse_failed=True, extras={"answer": reason})
    gold_text = _gold_text(ground_truth)
    try:
        gold = parse(f"\\boxed{{{gold_text}}}", extraction_config=config, parsing_timeout=parse_timeout)
        if not gold:
            raise ValueError(f"math ground truth {gold_text[:100]!r} cannot be parsed by math-verify")
        try:
            predicted = parse(
                f"\\boxed{{{answer}}}", extraction_config=config, parsing_timeout=parse_timeout, raise_on_error=True
            )
        except Exception:  # latex the parser rejects is the model's parse failure, not a crash
            predicted = []
        if not predicted:
            return RewardResult(score=0.0, parse_failed=True, extras={"answer": "unparseable"})
        # raise_on_error: a comparison that times out must surface as a time-out, not as "wrong".
        try:
            correct = verify(gold, predicted, timeout_seconds=verify_timeout, raise_on_error=True)
        except Exception:  # sympy failing to compare two valid expressions: treat as not equal
            correct = False
    except TimeoutException:
        return RewardResult(score=0.0, parse_failed=True, timed_out=True, extras={"answer": "timeout"})
    return RewardResult(score=1.0 if correct else 0.0, extras={"answer": "right" if correct else "wrong"})
