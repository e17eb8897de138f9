"""The toy "copy the digits" task ``toy_copy`` of the CPU demo: generator, word-level tokenizer, reward.

A row's prompt is ``copy 3 1 4 =`` and the right response is ``3 1 4`` followed by end of
sequence; the ``toy_copy`` reward gives 0.9 x the fraction of right positions + 0.1 for
stopping after the right number of tokens (below). Registered as task ``toy_copy`` (and
its reward as reward ``toy_copy``) when :mod:`megatron_rl.tasks` is imported: no system
prompt, no pre-fill, one eval group ``all``; ``megatron-rl generate-data toy`` writes the
prompts and the tokenizer.

Why this task: a random-init model samples near-uniformly from the vocabulary, so the
reward must be reachable by chance and dense. With the 15-token vocabulary below a
random response scores about 0.06 and, in a group of 4 samples, some sample gets at least
one digit right about half the time, so GRPO has a signal from the first step. The skill
(attend to the i-th digit of the prompt) is one a 2-layer transformer learns quickly. In
a stand-alone GRPO sketch (8 prompts x 4 samples, lr 1e-3, hidden 64, 2 layers, 3 digits)
the mean reward went from about 0.06 to 0.5, 0.98 and 0.98 within 400-600 steps over three
seeds (about 0.01 s per step); ``--num-digits 2`` learns faster. The actual trainer's
numbers are its own test's to report.

The tokenizer is built locally (no downloads) with the ``tokenizers`` library: a
:class:`tokenizers.models.WordLevel` model over :data:`TOY_VOCAB` with whitespace
splitting, wrapped as a ``transformers.PreTrainedTokenizerFast`` with ``<eos>`` and
``<pad>``. It has no chat template: use ``data.prompt_template: none``. Give the tiny
model ``vocab_size = len(TOY_VOCAB)`` (15): every extra logit is a token a random-init
model would sample and that can never be right.

Reward
------

The reward is dense so that a random-init policy gets a learning signal from step one:

    score = 0.9 * (fraction of target positions whose token is right)
          + 0.1 * (the response has exactly as many tokens as the target, i.e. it stopped)

Tokens are whitespace-separated; ``<eos>`` ends the response and ``<pad>`` is dropped, so
the score does not depend on whether the rollout decodes special tokens. A response of
random tokens from a 15-token vocabulary scores about 0.06 on average; a perfect one 1.0.
"""

from __future__ import annotations

import argparse
import os
import random
from pathlib import Path
from typing import Any

from megatron_rl.rewards.registry import RewardResult, get_reward, register_reward
from megatron_rl.tasks.base import DataGenerator, Splits, Task, check_counts, register_task

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
TOY_VOCAB: tuple[str, ...] = (PAD, EOS, UNK, "copy", "=", *(str(d) for d in range(10)))
"""The whole vocabulary, id = position: special tokens first, then the task words and digits."""

DEFAULT_NUM_DIGITS = 3


def copy_example(rng: random.Random, num_digits: int = DEFAULT_NUM_DIGITS) -> tuple[str, str]:
    """``(prompt, target)``, e.g. ``("copy 3 1 4 =", "3 1 4")``."""
    digits = " ".join(str(rng.randrange(10)) for _ in range(num_digits))
    return f"copy {digits} =", digits


def generate_splits(
    *, num_train: int, num_test: int, num_digits: int = DEFAULT_NUM_DIGITS, seed: int = 0
) -> dict[str, list[dict[str, Any]]]:
    """``{"train": rows, "test": rows}``; test targets never occur in train.

    Targets are distinct across both splits (there are ``10**num_digits``; asking for
    more rows is an error), and the test split does not depend on ``num_train``.
    """
    if num_digits < 1:
        raise ValueError(f"num_digits must be >= 1, got {num_digits}")
    if num_train < 0 or num_test < 0:
        raise ValueError(f"num_train and num_test must be >= 0, got {num_train} and {num_test}")
    space = 10**num_digits
    if num_train + num_test > space:
        raise ValueError(f"{num_train} + {num_test} rows asked, but only {space} distinct {num_digits}-digit targets")
    # Distinct targets drawn one at a time (rejecting repeats), so the first `num_test`
    # (the test split) do not depend on `num_train`, and the splits cannot overlap.
    rng = random.Random(f"toy-copy:{seed}:{num_digits}")
    codes: dict[int, None] = {}
    while len(codes) < num_train + num_test:
        codes.setdefault(rng.randrange(space))
    splits: dict[str, list[dict[str, Any]]] = {"test": [], "train": []}
    for i, code in enumerate(codes):
        split = "test" if i < num_test else "train"
        index = i if split == "test" else i - num_test
        target = " ".join(str(code).zfill(num_digits))
        splits[split].append(
            {"id": f"toy_copy_{split}_{index:05d}", "prompt": f"copy {target} =", "ground_truth": target,
             "num_digits": num_digits, "split": split}
        )  # fmt: skip
    return {"train": splits["train"], "test": splits["test"]}


def build_toy_tokenizer() -> Any:
    """The toy tokenizer as a ``transformers.PreTrainedTokenizerFast`` (built in memory)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(TOY_VOCAB)}, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # No decoder: WordLevel ids decode to tokens joined by single spaces, which is the
    # toy task's text format.
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=EOS, pad_token=PAD, unk_token=UNK, model_max_length=512
    )


def save_toy_tokenizer(directory: str | os.PathLike) -> Path:
    """Write ``tokenizer.json`` + ``tokenizer_config.json`` to ``directory`` (loadable with
    ``AutoTokenizer.from_pretrained(directory)``); returns the directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    build_toy_tokenizer().save_pretrained(str(directory))
    return directory


# --------------------------------------------------------------------------- reward


DIGIT_WEIGHT = 0.9
"""Weight of the per-position partial credit."""

STOP_WEIGHT = 0.1
"""Weight of stopping after exactly as many tokens as the target has."""


def response_tokens(response: str) -> list[str]:
    """Whitespace tokens of ``response`` up to the first ``<eos>``, without ``<pad>``."""
    tokens = [t for t in response.split() if t != PAD]
    return tokens[: tokens.index(EOS)] if EOS in tokens else tokens


def score_copy(response: str, ground_truth: Any) -> RewardResult:
    """Partial credit per right position plus a bonus for stopping (see module doc)."""
    target_text = ground_truth.get("answer") if isinstance(ground_truth, dict) else ground_truth
    if not isinstance(target_text, str) or not target_text.split():
        raise ValueError(f"toy_copy ground truth must be a non-empty string of tokens, got {ground_truth!r}")
    target = target_text.split()
    tokens = response_tokens(response)
    num_right = sum(1 for got, want in zip(tokens, target) if got == want)
    stopped = len(tokens) == len(target)
    score = DIGIT_WEIGHT * num_right / len(target) + STOP_WEIGHT * stopped
    return RewardResult(score=score, extras={"num_right": num_right, "stopped": stopped})


@register_reward("toy_copy", failure_score=0.0, success_score=1.0)
def toy_copy(response: str, ground_truth: Any) -> RewardResult:
    """Dense copy-task reward in [0, 1]; 1.0 only for the exact target followed by a stop."""
    return score_copy(response, ground_truth)


# --------------------------------------------------------------------------- task


def _add_generator_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-train", type=int, default=800, help="training prompts (default: 800)")
    parser.add_argument("--num-test", type=int, default=200, help="test prompts (default: 200)")
    parser.add_argument("--num-digits", type=int, default=3, help="digits to copy per prompt (default: 3)")


def _check_generator_arguments(args: argparse.Namespace) -> str | None:
    if args.num_digits < 1:
        return f"--num-digits must be >= 1, got {args.num_digits}"
    return check_counts(args, "--num-train", "--num-test")


def _generate(args: argparse.Namespace) -> Splits:
    return generate_splits(num_train=args.num_train, num_test=args.num_test, num_digits=args.num_digits, seed=args.seed)


def _write_tokenizer(out: Path, args: argparse.Namespace) -> None:
    save_toy_tokenizer(out / "tokenizer")


TASK = register_task(
    Task(
        name="toy_copy",
        reward=get_reward("toy_copy"),
        generator=DataGenerator(
            command="toy",
            help="the CPU demo's copy-the-digits task, plus its tokenizer",
            add_arguments=_add_generator_arguments,
            check=_check_generator_arguments,
            generate=_generate,
            write_extras=_write_tokenizer,
        ),
    )
)
"""The ``toy_copy`` task."""
