"""Turning a row's prompt field into the text the model sees (config ``data.prompt_template``).

A task's prompt has two parts besides the question: an optional system prompt and an
optional pre-fill that starts the assistant turn (K&K pre-fills ``<think>``). These are
the task's :class:`PromptStyle`, looked up by reward name (:func:`prompt_style_for`).

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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

PromptTemplate = Literal["chat", "literal", "none"]


@dataclass(kw_only=True, frozen=True)
class PromptStyle:
    """The fixed parts of a task's prompt."""

    system_prompt: str | None = None
    """System message; ``None`` for no system message."""

    assistant_prefill: str = ""
    """Text that starts the assistant turn (the model continues from it)."""


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

MATH_STYLE = PromptStyle(
    system_prompt="Please reason step by step, and put your final answer within \\boxed{}."
)  # fmt: skip
"""Math: the usual Qwen-math instruction, so that the ``math`` reward finds a ``\\boxed{}``."""

PLAIN_STYLE = PromptStyle()
"""No system prompt, no pre-fill (the toy task, user rewards)."""

TASK_PROMPT_STYLES: dict[str, PromptStyle] = {"kk_logic": KK_STYLE, "math": MATH_STYLE, "toy_copy": PLAIN_STYLE}
"""Prompt style of each built-in reward; any other reward gets :data:`PLAIN_STYLE`."""


def prompt_style_for(reward: str) -> PromptStyle:
    """The prompt style that goes with reward ``reward`` (config ``data.reward``)."""
    return TASK_PROMPT_STYLES.get(reward, PLAIN_STYLE)


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
