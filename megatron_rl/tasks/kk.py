"""The Knights-and-Knaves task ``kk_logic``: puzzle generator, prompt style and Logic-RL's reward.

Registered as task ``kk_logic`` (and its reward as reward ``kk_logic``) when
:mod:`megatron_rl.tasks` is imported. Eval accuracy is reported per puzzle size
(``n3``, ``n4``, ... from a row's ``num_people``; ``all`` for rows without it), and
``megatron-rl generate-data kk`` writes the puzzles.

Puzzles
-------

A seeded generator, a brute-force solver, train/test splits.

Knights always tell the truth and knaves always lie. A puzzle has N people (names from
:data:`NAMES`), each making one statement; a statement is a claim about one person
("Zoey is a knight"), its negation ("Zoey is not a knave"), or two claims about two
different people joined by and / or / if-then / if-and-only-if. Person ``p`` is
consistent when ``is_knight[p] == statement_p(assignment)``; the solver tries all ``2^N``
assignments and a puzzle is kept only when exactly one is consistent.

Statements are nested lists over person indices (JSON, names-free):

    ["is", p, "knight"]            p is a knight            (role "knight" or "knave")
    ["not", ["is", p, role]]       p is not a <role>
    [op, claim_a, claim_b]         op in and, or, if, iff; claims are "is" forms about
                                   two different people

Generation is deterministic: each N draws from its own ``random.Random`` seeded by
``(seed, N)``, so the puzzles for one N do not change when other Ns are added. Within an
N, unique puzzles are drawn in order and de-duplicated by logic, not wording: two
puzzles are the same when every person's statement has the same truth table (so names,
"not a knight" vs "a knave" and operand order do not make a new puzzle); the first ``test_per_n`` form the test split
and the next ``train_per_n`` the train split, so the test set does not depend on the
train size and the splits never overlap.

Rows (:func:`puzzle_row`): ``prompt`` (the puzzle as the user question), ``ground_truth``
(``{"solution": [{"name", "role"}, ...], "solution_text_format": "(1) Zoey is a knight\\n..."}``,
the latter in Logic-RL's key and format), ``num_people``, ``id``, ``split`` and
``statements`` (the structure as a JSON string, for re-solving).

Prompt
------

:data:`KK_STYLE`: the reasoning/answer-tag system prompt :data:`KK_SYSTEM_PROMPT`, with the
assistant turn pre-filled with ``<think>``.

Reward
------

The Knights-and-Knaves reward of Logic-RL (format + answer), exactly as its code scores.

Follows ``verl/utils/reward_score/kk.py`` of Logic-RL as used by the AR/Lopti runs
(``docs/data_and_rewards.md`` walks through it):

- The checked text is the assistant turn, found as Logic-RL finds it: in prompt +
  response, everything after the first ``Assistant:`` header, else after the first
  ``<|im_start|>assistant`` (Logic-RL looks for ``Assistant:`` first, so one in the
  response wins over a chat-template header in the prompt). A pre-fill (``<think>`` for
  the K&K prompt, or any longer text) is thus part of the checked text wherever it sits.
  When the prompt has no assistant header at all (a bare question, ``prompt_template:
  none``), the checked text is the response, preceded by ``<think>`` when the prompt
  ends with it (:func:`score_kk`).
- Format: +1 when ``<think>``, ``</think>``, ``<answer>``, ``</answer>`` each occur exactly
  once, in that order, in the checked text; else -1. So a pre-filled ``<think>`` counts
  and a second one in the response breaks the format. Tags are matched
  case-sensitively (``<Think>`` is not a tag).
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

import argparse
import itertools
import json
import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_rl.data.loaders import PromptRow
from megatron_rl.data.prompts import PromptStyle
from megatron_rl.rewards.registry import RewardResult, get_reward, register_reward
from megatron_rl.tasks.base import DataGenerator, Splits, Task, check_counts, register_task
from megatron_rl.tasks.bpe_tokenizer import write_bpe_tokenizer

NAMES: tuple[str, ...] = (
    "Zoey", "Oliver", "Ethan", "Mia", "Liam", "Ava", "Noah", "Emma", "Lucas", "Sofia",
    "Jack", "Chloe", "Owen", "Grace", "Henry", "Lily", "Samuel", "Ella", "Daniel", "Harper",
    "Leo", "Aria", "Mason", "Nora", "James", "Ruby", "Isaac", "Zara",
)  # fmt: skip
"""Single alphabetic words (the answer parser matches ``\\bName\\b``), none containing
"knight" or "knave"."""

ROLES = ("knight", "knave")
MIN_PEOPLE, MAX_PEOPLE = 2, 10
"""Supported puzzle sizes (brute force is ``2^N``; uniqueness gets rarer as N grows)."""

OPERATORS = ("and", "or", "if", "iff")

# Relative frequency of statement kinds: a mix of simple and compound statements keeps
# puzzles solvable by reasoning while making uniqueness common enough.
_KIND_WEIGHTS = {"is": 3, "not": 1, "and": 2, "or": 2, "if": 2, "iff": 2}

Statement = list[Any]


@dataclass(kw_only=True, frozen=True)
class Puzzle:
    """One K&K puzzle with its unique solution."""

    names: tuple[str, ...]
    """The people, in the order they are introduced."""

    statements: tuple[Statement, ...]
    """``statements[p]`` is what person ``p`` says (structure in the module doc)."""

    is_knight: tuple[bool, ...]
    """The unique consistent assignment: ``True`` for a knight."""

    @property
    def num_people(self) -> int:
        """N."""
        return len(self.names)

    @property
    def key(self) -> str:
        """Canonical form used to de-duplicate: each statement's truth table over all ``2^N``
        assignments. Names-free, and equal for logically identical puzzles worded
        differently ("Zoey is not a knight" vs "Zoey is a knave", "A and B" vs "B and A")."""
        return ",".join(str(truth_table(s, self.num_people)) for s in self.statements)

    def solution(self) -> list[dict[str, str]]:
        """``[{"name": ..., "role": "knight" | "knave"}, ...]`` in introduction order."""
        return [{"name": n, "role": role_name(k)} for n, k in zip(self.names, self.is_knight)]

    def solution_text(self) -> str:
        """The answer in the prompt's format: ``(1) Zoey is a knight`` lines (Logic-RL's ``solution_text_format``)."""
        return "\n".join(f"({i}) {s['name']} is a {s['role']}" for i, s in enumerate(self.solution(), 1))

    def question(self) -> str:
        """The puzzle text given to the model as the user question."""
        return render_question(self.names, self.statements)


# --------------------------------------------------------------------------- logic


def evaluate(statement: Statement, is_knight: Sequence[bool]) -> bool:
    """Truth value of ``statement`` under an assignment (``True`` = knight)."""
    op = statement[0]
    if op == "is":
        return is_knight[statement[1]] == (statement[2] == "knight")
    if op == "not":
        return not evaluate(statement[1], is_knight)
    a, b = evaluate(statement[1], is_knight), evaluate(statement[2], is_knight)
    if op == "and":
        return a and b
    if op == "or":
        return a or b
    if op == "if":
        return (not a) or b
    if op == "iff":
        return a == b
    raise ValueError(f"unknown statement operator {op!r} in {statement!r}")


def truth_table(statement: Statement, num_people: int) -> int:
    """Bit ``i`` = the statement's truth under the ``i``-th assignment of ``itertools.product``."""
    bits = 0
    for i, assignment in enumerate(itertools.product((True, False), repeat=num_people)):
        bits |= evaluate(statement, assignment) << i
    return bits


def solutions(statements: Sequence[Statement], *, limit: int | None = None) -> list[tuple[bool, ...]]:
    """All consistent assignments by brute force over ``2^N`` (stops after ``limit`` found).

    Consistent: every knight's statement is true and every knave's is false.
    """
    found = []
    for assignment in itertools.product((True, False), repeat=len(statements)):
        if all(evaluate(s, assignment) == knight for s, knight in zip(statements, assignment)):
            found.append(assignment)
            if limit is not None and len(found) >= limit:
                break
    return found


def _random_claim(rng: random.Random, person: int) -> Statement:
    return ["is", person, rng.choice(ROLES)]


def random_statement(rng: random.Random, num_people: int) -> Statement:
    """A random statement about the ``num_people`` people (see module doc for the kinds)."""
    kind = rng.choices(list(_KIND_WEIGHTS), weights=list(_KIND_WEIGHTS.values()))[0]
    if kind == "is":
        return _random_claim(rng, rng.randrange(num_people))
    if kind == "not":
        return ["not", _random_claim(rng, rng.randrange(num_people))]
    a, b = rng.sample(range(num_people), 2)  # two different people: "A is a knight and A is a knave" is noise
    return [kind, _random_claim(rng, a), _random_claim(rng, b)]


def random_puzzle(rng: random.Random, num_people: int, *, max_attempts: int = 100_000) -> Puzzle:
    """Draw statements until exactly one assignment is consistent."""
    if not MIN_PEOPLE <= num_people <= MAX_PEOPLE:
        raise ValueError(f"num_people must be in [{MIN_PEOPLE}, {MAX_PEOPLE}], got {num_people}")
    for _ in range(max_attempts):
        names = tuple(rng.sample(NAMES, num_people))
        statements = tuple(random_statement(rng, num_people) for _ in range(num_people))
        found = solutions(statements, limit=2)
        if len(found) == 1:
            return Puzzle(names=names, statements=statements, is_knight=found[0])
    raise RuntimeError(f"no puzzle with a unique solution for {num_people} people in {max_attempts} attempts")


# --------------------------------------------------------------------------- text


def role_name(knight: bool) -> str:
    """``knight`` or ``knave``."""
    return ROLES[0] if knight else ROLES[1]


def _claim_text(claim: Statement, names: Sequence[str], assignment: Sequence[bool] | None) -> str:
    if claim[0] == "not":
        inner = claim[1]
        text = f"{names[inner[1]]} is not a {inner[2]}"
    else:
        text = f"{names[claim[1]]} is a {claim[2]}"
    return text if assignment is None else f"{text} ({'yes' if evaluate(claim, assignment) else 'no'})"


def statement_text(statement: Statement, names: Sequence[str], assignment: Sequence[bool] | None = None) -> str:
    """English for a statement, e.g. ``If Zoey is a knight then Oliver is a knave``; with an
    ``assignment``, each claim followed by its truth under it (the worked solutions'
    ``If Zoey is a knight (yes) then Oliver is a knave (no)``)."""
    op = statement[0]
    if op in ("is", "not"):
        return _claim_text(statement, names, assignment)
    a, b = _claim_text(statement[1], names, assignment), _claim_text(statement[2], names, assignment)
    if op == "if":
        return f"If {a} then {b}"
    if op == "iff":
        return f"{a} if and only if {b}"
    return f"{a} {op} {b}"


def _join_names(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + f"{',' if len(names) > 2 else ''} and {names[-1]}"


def render_question(names: Sequence[str], statements: Sequence[Statement]) -> str:
    """The whole puzzle as one paragraph, ending with the question."""
    said = " ".join(f'{names[p]} says, "{statement_text(s, names)}."' for p, s in enumerate(statements))
    return (
        "A very special island is inhabited only by knights and knaves. Knights always tell the truth, "
        f"and knaves always lie. You meet {len(names)} inhabitants: {_join_names(names)}. {said} "
        "So who is a knight and who is a knave?"
    )


def reasoning_trace(puzzle: Puzzle) -> str:
    """A worked solution by cases, in the solver's order, up to the consistent one: for each
    assignment of roles, each person's statement (after the speaker's role in the case) with
    every claim checked against the case, its truth, and whether the role allows it; a case
    stops at the first statement that breaks it, and the consistent case ends ``Every
    statement fits.`` (the solution is unique, so the cases after it are not tried). What a
    model learns to write in ``<think>`` from SFT rows (``--sft-responses``).

    Why claim by claim: each step looks up one fact stated earlier (a name's role in the
    case line, or the speaker's statement in the prompt), which a model of a few million
    parameters learns; a one-line verdict per case, which folds the lookups of all the
    statements into one token, stayed near chance at that size."""
    lines = []
    for assignment in itertools.product((True, False), repeat=puzzle.num_people):
        role = [role_name(knight) for knight in assignment]
        lines.append(f"Case: {', '.join(f'{name} {r}' for name, r in zip(puzzle.names, role))}.")
        for p, (name, statement) in enumerate(zip(puzzle.names, puzzle.statements)):
            truth = evaluate(statement, assignment)
            verdict = "fits" if truth == assignment[p] else "impossible"
            checked = statement_text(statement, puzzle.names, assignment)
            lines.append(f"{name} ({role[p]}) says {checked}: {'true' if truth else 'false'}, {verdict}.")
            if verdict == "impossible":
                break
        else:
            lines.append("Every statement fits.")
            break
    return "\n".join(lines)


def sft_response(puzzle: Puzzle) -> str:
    """A supervised response to the K&K prompt, which pre-fills ``<think>``: the trace of
    :func:`reasoning_trace`, ``</think>``, then the answer in the format the ``kk_logic``
    reward parses (it scores the full 3.0)."""
    return f"\n{reasoning_trace(puzzle)}\n</think>\n<answer>\n{puzzle.solution_text()}\n</answer>"


# --------------------------------------------------------------------------- datasets


def _rng_for(seed: int, num_people: int) -> random.Random:
    # A string seed is hashed with SHA-512 by `random`, independent of PYTHONHASHSEED.
    return random.Random(f"kk:{seed}:{num_people}")


def unique_puzzles(num_people: int, *, seed: int) -> Iterator[Puzzle]:
    """Endless stream of structurally distinct puzzles for one N, deterministic by ``seed``."""
    rng = _rng_for(seed, num_people)
    seen: set[str] = set()
    misses = 0
    while True:
        puzzle = random_puzzle(rng, num_people)
        if puzzle.key in seen:
            misses += 1
            if misses > 10_000:  # the space for this N is (nearly) exhausted
                raise RuntimeError(
                    f"cannot find more than {len(seen)} distinct {num_people}-people puzzles; ask for fewer"
                )
            continue
        misses = 0
        seen.add(puzzle.key)
        yield puzzle


def puzzle_row(puzzle: Puzzle, *, split: str, index: int, sft_response_field: bool = False) -> dict[str, Any]:
    """The jsonl/parquet row of a puzzle (fields in the module doc; with
    ``sft_response_field`` also ``response``: :func:`sft_response`)."""
    return {
        "id": f"kk_{puzzle.num_people}ppl_{split}_{index:05d}",
        "prompt": puzzle.question(),
        "ground_truth": {"solution": puzzle.solution(), "solution_text_format": puzzle.solution_text()},
        "num_people": puzzle.num_people,
        "split": split,
        "statements": json.dumps(puzzle.statements, separators=(",", ":")),
    } | ({"response": sft_response(puzzle)} if sft_response_field else {})


def generate_splits(
    num_people: Sequence[int], *, train_per_n: int, test_per_n: int, seed: int, sft_responses: bool = False
) -> dict[str, list[dict[str, Any]]]:
    """``{"train": rows, "test": rows}`` over all requested N (rows ordered by N, then index;
    ``sft_responses``: each with a ``response`` field, the same puzzles otherwise)."""
    if train_per_n < 0 or test_per_n < 0:
        raise ValueError(f"train_per_n and test_per_n must be >= 0, got {train_per_n} and {test_per_n}")
    if len(set(num_people)) != len(num_people):
        raise ValueError(f"num_people has duplicates: {list(num_people)}")
    splits: dict[str, list[dict[str, Any]]] = {"train": [], "test": []}
    for n in num_people:
        stream = unique_puzzles(n, seed=seed)
        for split, count in (("test", test_per_n), ("train", train_per_n)):
            splits[split] += [puzzle_row(next(stream), split=split, index=i, sft_response_field=sft_responses)
                              for i in range(count)]  # fmt: skip
    return splits


# --------------------------------------------------------------------------- prompt


KK_SYSTEM_PROMPT = (
    "You are a helpful assistant. First reason about the problem step by step, then give the user "
    "your answer. Put the reasoning inside <think> </think> tags and the answer inside <answer> </answer> "
    "tags, i.e. <think> reasoning here </think> <answer> answer here </answer>. The user asks you to solve "
    "a logic puzzle. When you reach a conclusion, state the identity of every character inside the "
    "<answer> </answer> tags, one per line, e.g. <answer> (1) Zoey is a knight\n(2) ... </answer>."
)
"""The K&K system prompt: reasoning in ``<think>``, the answer in ``<answer>`` as numbered
``(k) Name is a knight/knave`` lines (the format the ``kk_logic`` reward parses). Our own
wording of the instruction the K&K papers use; see docs/data_and_rewards.md."""

KK_STYLE = PromptStyle(system_prompt=KK_SYSTEM_PROMPT, assistant_prefill="<think>")
"""K&K: the reasoning/answer-tag system prompt, assistant turn pre-filled with ``<think>``."""


# --------------------------------------------------------------------------- reward


THINK_OPEN, THINK_CLOSE, ANSWER_OPEN, ANSWER_CLOSE = "<think>", "</think>", "<answer>", "</answer>"
_TAGS = (THINK_OPEN, THINK_CLOSE, ANSWER_OPEN, ANSWER_CLOSE)

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
    return score_assistant_turn((THINK_OPEN if think_prefilled else "") + response, ground_truth)


def score_assistant_turn(assistant_text: str, ground_truth: Any) -> RewardResult:
    """Score the checked text of a K&K answer (the assistant turn, pre-fill included)."""
    solution = expected_roles(ground_truth)
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


ASSISTANT_HEADERS = ("Assistant:", "<|im_start|>assistant")
"""The assistant-turn headers Logic-RL splits on, in the order it tries them."""


def assistant_turn(prompt: str, response: str) -> str | None:
    """The text Logic-RL checks: prompt + response after the first assistant header.

    Headers are tried in :data:`ASSISTANT_HEADERS` order over the whole text, as
    Logic-RL's ``extract_solution`` does. ``None`` when the prompt holds no header (the
    caller then scores the response alone, see :func:`score_kk`).
    """
    if not any(header in prompt for header in ASSISTANT_HEADERS):
        return None
    text = prompt + response
    header = next(h for h in ASSISTANT_HEADERS if h in text)
    return text.split(header, 1)[1]


@register_reward("kk_logic", failure_score=MIN_SCORE, success_score=MAX_SCORE)
def kk_logic(response: str, ground_truth: Any, *, prompt: str = "") -> RewardResult:
    """Logic-RL's K&K reward (totals 3 / -0.5 / -1 / -3) of the assistant turn of
    ``prompt`` + ``response`` (module docstring); a prompt without an assistant header
    scores the response alone, with ``<think>`` when the prompt ends with it."""
    turn = assistant_turn(prompt, response)
    if turn is None:
        return score_kk(response, ground_truth, think_prefilled=prompt_prefills_think(prompt))
    return score_assistant_turn(turn, ground_truth)


# --------------------------------------------------------------------------- task


def num_people_group(row: PromptRow) -> str:
    """A row's eval group: ``n<N>`` for a puzzle of N people, ``all`` when the row has no ``num_people``."""
    return f"n{row.metadata['num_people']}" if "num_people" in row.metadata else "all"


KK_TOKENIZER_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
"""The special tokens of ``--tokenizer`` (ids 0-2): the end of sequence (also padding) and
ChatML's markers; the four K&K tags follow (ids 3-6), single tokens that decoding keeps."""

KK_TOKENIZER_VOCAB_SIZE = 1024
"""``--tokenizer-vocab-size``'s default: bytes + specials + merges, enough that names and the
puzzle's words are mostly one token each."""


def _add_generator_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-people", type=int, nargs="+", default=[3, 4, 5, 6, 7], metavar="N",
                        help="puzzle sizes to generate (default: 3 4 5 6 7)")  # fmt: skip
    parser.add_argument("--train-per-n", type=int, default=900, help="training puzzles per size (default: 900)")
    parser.add_argument("--test-per-n", type=int, default=100, help="test puzzles per size (default: 100)")
    parser.add_argument("--sft-responses", action="store_true",
                        help="also write each row's worked solution as a 'response' field (megatron-rl sft data)")  # fmt: skip
    parser.add_argument("--tokenizer", action="store_true",
                        help="also train a byte-level BPE tokenizer on the train rows into OUT/tokenizer "
                             "(for models trained from scratch on CPU)")  # fmt: skip
    parser.add_argument("--tokenizer-vocab-size", type=int, default=KK_TOKENIZER_VOCAB_SIZE,
                        help=f"its vocabulary (default: {KK_TOKENIZER_VOCAB_SIZE})")  # fmt: skip


def _check_generator_arguments(args: argparse.Namespace) -> str | None:
    bad = [n for n in args.num_people if not MIN_PEOPLE <= n <= MAX_PEOPLE]
    if bad:
        return f"--num-people {bad}: sizes must be in [{MIN_PEOPLE}, {MAX_PEOPLE}]"
    if len(set(args.num_people)) != len(args.num_people):
        return f"--num-people {args.num_people} has duplicates"
    if not 300 <= args.tokenizer_vocab_size <= 1 << 17:
        return f"--tokenizer-vocab-size {args.tokenizer_vocab_size}: must be in [300, 131072] (256 bytes + specials + merges)"
    return check_counts(args, "--train-per-n", "--test-per-n")


def _generate(args: argparse.Namespace) -> Splits:
    return generate_splits(args.num_people, train_per_n=args.train_per_n, test_per_n=args.test_per_n, seed=args.seed,
                           sft_responses=args.sft_responses)  # fmt: skip


def _write_tokenizer(out: Path, args: argparse.Namespace) -> None:
    if args.tokenizer:
        write_bpe_tokenizer(out / "tokenizer", out / "train.jsonl", style=KK_STYLE, special_tokens=KK_TOKENIZER_SPECIALS,
                            tags=_TAGS, vocab_size=args.tokenizer_vocab_size)  # fmt: skip


def _per_size(splits: Splits, args: argparse.Namespace) -> dict[str, Splits]:
    # One directory per size, for curricula and per-N evaluation.
    return {
        f"{n}ppl": {split: [r for r in rows if r["num_people"] == n] for split, rows in splits.items()}
        for n in args.num_people
    }


TASK = register_task(
    Task(
        name="kk_logic",
        reward=get_reward("kk_logic"),
        prompt_style=KK_STYLE,
        eval_group=num_people_group,
        generator=DataGenerator(
            command="kk",
            help="Knights-and-Knaves puzzles with unique solutions (Logic-RL format)",
            add_arguments=_add_generator_arguments,
            check=_check_generator_arguments,
            generate=_generate,
            subsets=_per_size,
            write_extras=_write_tokenizer,
        ),
    )
)
"""The ``kk_logic`` task."""
