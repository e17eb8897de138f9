"""Prompt/response rows as token ids for supervised fine-tuning (``megatron-rl sft``).

A row's prompt is rendered exactly as an RL run renders it for the engines
(:func:`~megatron_rl.data.prompts.render_prompt`: the task's system prompt, the chat or
literal template, the pre-fill) and tokenised on its own; the response is tokenised on its
own and ends with the tokenizer's end-of-sequence token. Tokenising the two apart puts
the boundary where an RL run has it (an engine continues the prompt's tokens), so the
model learns the responses in the token split it will generate them in. The loss is on
the response tokens and the end-of-sequence token (the model learns to stop).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megatron_rl.data.loaders import DataError, SFTRow
from megatron_rl.data.prompts import PromptStyle, PromptTemplate, render_prompt, tokenize
from megatron_rl.data.sampler import PromptSampler

__all__ = ["SFTExamples", "SFTSource", "encode_sft_rows"]


@dataclass(frozen=True)
class SFTExamples:
    """Rows and their token ids, same order."""

    rows: list[SFTRow]
    prompt_ids: list[list[int]]
    """The rendered prompt's tokens."""
    response_ids: list[list[int]]
    """The response's tokens, the end-of-sequence token last."""

    def __len__(self) -> int:
        return len(self.rows)


def encode_sft_rows(
    rows: Sequence[SFTRow], tokenizer: Any, *, template: PromptTemplate, style: PromptStyle, max_sequence_tokens: int,
    batch_size: int = 1024,
) -> SFTExamples:
    """Every row tokenised (batched where the tokenizer can). Raises :class:`DataError` naming
    the file, row and field for a prompt or response that tokenises to nothing, or a row
    longer than ``max_sequence_tokens`` (``data.max_sequence_tokens``), and a ``ValueError``
    for a tokenizer without an end-of-sequence token."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no end-of-sequence token: SFT responses must end with one")
    prompts: list[list[int]] = []
    responses: list[list[int]] = []
    for lo in range(0, len(rows), batch_size):
        chunk = rows[lo : lo + batch_size]
        texts = [render_prompt(r.prompt, template=template, style=style, tokenizer=tokenizer) for r in chunk]
        prompts += tokenize(tokenizer, texts)
        responses += [ids + [eos] for ids in tokenize(tokenizer, [r.response for r in chunk])]
    for row, p, r in zip(rows, prompts, responses):
        if not p:
            raise DataError("the prompt is empty after tokenisation", file=row.file, row=row.row, field="prompt")
        if len(r) == 1:
            raise DataError("the response is empty after tokenisation", file=row.file, row=row.row, field="response")
        if len(p) + len(r) > max_sequence_tokens:
            raise DataError(
                f"prompt ({len(p)} tokens) + response with its end-of-sequence token ({len(r)}) = {len(p) + len(r)} "
                f"tokens, more than data.max_sequence_tokens={max_sequence_tokens}",
                file=row.file, row=row.row, field="response",
            )  # fmt: skip
    return SFTExamples(rows=list(rows), prompt_ids=prompts, response_ids=responses)


class SFTSource:
    """Training examples drawn in a seeded order that survives a resume (the RL run's
    :class:`~megatron_rl.data.sampler.PromptSampler`), and the eval examples."""

    def __init__(self, train: SFTExamples, eval_: SFTExamples | None, *, seed: int, shuffle: bool, pad_id: int):
        self.train = train
        self.eval = eval_
        self.sampler = PromptSampler(len(train), seed=seed, shuffle=shuffle)
        self.pad_id = pad_id
        """Id written into batch padding (never trained on)."""

    def next_examples(self, num_rows: int) -> list[tuple[list[int], list[int]]]:
        """The next ``num_rows`` training examples as ``(prompt_ids, response_ids)`` (advances the order)."""
        return [(self.train.prompt_ids[i], self.train.response_ids[i]) for i in self.sampler.next_indices(num_rows)]

    def eval_examples(self) -> list[tuple[list[int], list[int]]]:
        """Every eval example, in file order (none without ``data.eval_files``)."""
        if self.eval is None:
            return []
        return list(zip(self.eval.prompt_ids, self.eval.response_ids))

    def state_dict(self) -> dict[str, Any]:
        """The position in the training order (saved in every checkpoint)."""
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)
