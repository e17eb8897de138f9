"""Turning a row's prompt field into the text the model sees (config ``data.prompt_template``).

A task's prompt has two parts besides the question: an optional system prompt and an
optional pre-fill that starts the assistant turn (K&K pre-fills ``<think>``). These are
the task's :class:`PromptStyle`, which comes from the task (``Task.prompt_style`` in
:mod:`megatron_rl.tasks`); this module knows no task.

- ``chat``: the question as a user message (after the system message, if any) in the
  tokenizer's chat template with ``add_generation_prompt=True``, then the pre-fill. A
  tokenizer without a chat template (or none at all) gets the ``literal`` text instead.
- ``literal``: always the fixed Qwen (ChatML) text, whatever the tokenizer::

      <|im_start|>system
      {system}<|im_end|>
      <|im_start|>user
      {question}<|im_end|>
      <|im_start|>assistant
      {prefill}

  (line breaks as shown, no trailing one; the system block is left out when the style has
  no system prompt). This is what Qwen2.5's own chat template produces for a system +
  user conversation.
- ``none``: the prompt field unchanged (no system prompt, no pre-fill): for the toy task
  and for data that is already templated.

The K&K reward reads whether ``<think>`` was pre-filled from the rendered prompt, so a
prompt rendered here and scored by ``kk_logic`` agree by construction.

:class:`PromptEncoder` renders rows and tokenises them (what the trainer feeds the
rollout engines), checking each prompt's length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from megatron_rl.data.loaders import DataError, PromptRow

PromptTemplate = Literal["chat", "literal", "none"]


@dataclass(kw_only=True, frozen=True)
class PromptStyle:
    """The fixed parts of a task's prompt."""

    system_prompt: str | None = None
    """System message; ``None`` for no system message."""

    assistant_prefill: str = ""
    """Text that starts the assistant turn (the model continues from it)."""


PLAIN_STYLE = PromptStyle()
"""No system prompt, no pre-fill (the toy task, user reward functions)."""


def literal_chat_text(question: str, style: PromptStyle) -> str:
    """The fixed Qwen/ChatML text of a (system,) user turn and the opened assistant turn."""
    system = f"<|im_start|>system\n{style.system_prompt}<|im_end|>\n" if style.system_prompt is not None else ""
    return f"{system}<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n{style.assistant_prefill}"


def has_chat_template(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` (a transformers tokenizer, or ``None``) has a chat template."""
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def render_prompt(
    question: str, *, template: PromptTemplate, style: PromptStyle = PLAIN_STYLE, tokenizer: Any = None
) -> str:
    """The text the model is given for ``question`` (see the module doc for each template)."""
    if template == "none":
        return question
    if template == "chat" and has_chat_template(tokenizer):
        messages = [{"role": "user", "content": question}]
        if style.system_prompt is not None:
            messages.insert(0, {"role": "system", "content": style.system_prompt})
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return text + style.assistant_prefill
    if template in ("chat", "literal"):
        return literal_chat_text(question, style)
    raise ValueError(f"unknown prompt template {template!r}; expected 'chat', 'literal' or 'none'")


def tokenize(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, no special tokens added (templates hold theirs). One batched
    call where the tokenizer has it (the Rust tokenizers parallelise it); the same ids as
    ``encode`` gives one text at a time."""
    if callable(tokenizer) and hasattr(tokenizer, "batch_encode_plus"):
        return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


class PromptEncoder:
    """Rendered prompt texts and token ids for data rows.

    Each row's prompt is rendered with :func:`render_prompt` (``template``, ``style``, the
    tokenizer's chat template) and tokenised without special tokens (the template already
    holds them). A prompt that tokenises to nothing, or to more than ``max_prompt_tokens``
    tokens, raises :class:`~megatron_rl.data.loaders.DataError` naming its file, row and
    the field ``prompt``.
    """

    def __init__(self, tokenizer: Any, *, template: PromptTemplate, style: PromptStyle, max_prompt_tokens: int):
        self.tokenizer = tokenizer
        self.template = template
        self.style = style
        self.max_prompt_tokens = max_prompt_tokens

    def encode(self, rows: Sequence[PromptRow]) -> tuple[list[str], list[list[int]]]:
        """Rendered prompt texts and their token ids, one each per row, in order."""
        texts, ids = [], []
        for row in rows:
            text = render_prompt(row.prompt, template=self.template, style=self.style, tokenizer=self.tokenizer)
            tokens = self.tokenizer.encode(text, add_special_tokens=False)
            if not tokens:
                raise DataError("the prompt is empty after tokenisation", file=row.file, row=row.row, field="prompt")
            if len(tokens) > self.max_prompt_tokens:
                # Named as the config field that sets the limit: that is what a user changes.
                raise DataError(
                    f"the prompt has {len(tokens)} tokens, more than rollout.max_prompt_tokens="
                    f"{self.max_prompt_tokens}",
                    file=row.file, row=row.row, field="prompt",
                )  # fmt: skip
            texts.append(text)
            ids.append(tokens)
        return texts, ids

    def check(self, rows: Sequence[PromptRow], *, batch_size: int = 1024) -> None:
        """Render and tokenise every row once, before a run starts, so that a prompt that would
        fail :meth:`encode` fails now and not at the step that draws it.

        Raises :class:`~megatron_rl.data.loaders.DataError` for the first bad row (empty after
        tokenisation, or longer than ``max_prompt_tokens``), saying how many others are bad.
        """
        bad: list[tuple[PromptRow, int]] = []
        for lo in range(0, len(rows), batch_size):
            chunk = rows[lo : lo + batch_size]
            texts = [render_prompt(r.prompt, template=self.template, style=self.style, tokenizer=self.tokenizer)
                     for r in chunk]  # fmt: skip
            for row, ids in zip(chunk, tokenize(self.tokenizer, texts)):
                if not ids or len(ids) > self.max_prompt_tokens:
                    bad.append((row, len(ids)))
        if not bad:
            return
        row, length = bad[0]
        more = ""
        if len(bad) > 1:
            shown = ", ".join(f"{r.file} row {r.row}" for r, _ in bad[1:4])
            more = f" ({len(bad) - 1} more bad prompt(s): {shown}{', ...' if len(bad) > 4 else ''})"
        if length == 0:
            raise DataError("the prompt is empty after tokenisation" + more, file=row.file, row=row.row, field="prompt")
        raise DataError(
            f"the prompt has {length} tokens, more than rollout.max_prompt_tokens={self.max_prompt_tokens}" + more,
            file=row.file, row=row.row, field="prompt",
        )  # fmt: skip

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of generated ``token_ids``, special tokens (end of sequence, padding) left out."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)
