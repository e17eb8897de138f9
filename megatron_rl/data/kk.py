"""Knights-and-Knaves puzzles: a seeded generator, a brute-force solver, train/test splits.

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
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

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
        return [{"name": n, "role": ROLES[0] if k else ROLES[1]} for n, k in zip(self.names, self.is_knight)]

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


def _claim_text(claim: Statement, names: Sequence[str]) -> str:
    if claim[0] == "not":
        inner = claim[1]
        return f"{names[inner[1]]} is not a {inner[2]}"
    return f"{names[claim[1]]} is a {claim[2]}"


def statement_text(statement: Statement, names: Sequence[str]) -> str:
    """English for a statement, e.g. ``If Zoey is a knight then Oliver is a knave``."""
    op = statement[0]
    if op in ("is", "not"):
        return _claim_text(statement, names)
    a, b = _claim_text(statement[1], names), _claim_text(statement[2], names)
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


def puzzle_row(puzzle: Puzzle, *, split: str, index: int) -> dict[str, Any]:
    """The jsonl/parquet row of a puzzle (fields in the module doc)."""
    return {
        "id": f"kk_{puzzle.num_people}ppl_{split}_{index:05d}",
        "prompt": puzzle.question(),
        "ground_truth": {"solution": puzzle.solution(), "solution_text_format": puzzle.solution_text()},
        "num_people": puzzle.num_people,
        "split": split,
        "statements": json.dumps(puzzle.statements, separators=(",", ":")),
    }


def generate_splits(
    num_people: Sequence[int], *, train_per_n: int, test_per_n: int, seed: int
) -> dict[str, list[dict[str, Any]]]:
    """``{"train": rows, "test": rows}`` over all requested N (rows ordered by N, then index)."""
    if train_per_n < 0 or test_per_n < 0:
        raise ValueError(f"train_per_n and test_per_n must be >= 0, got {train_per_n} and {test_per_n}")
    if len(set(num_people)) != len(num_people):
        raise ValueError(f"num_people has duplicates: {list(num_people)}")
    splits: dict[str, list[dict[str, Any]]] = {"train": [], "test": []}
    for n in num_people:
        stream = unique_puzzles(n, seed=seed)
        for split, count in (("test", test_per_n), ("train", train_per_n)):
            splits[split] += [puzzle_row(next(stream), split=split, index=i) for i in range(count)]
    return splits
