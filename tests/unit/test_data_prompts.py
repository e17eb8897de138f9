"""Prompt rendering: ``chat`` (tokenizer template, else literal), ``literal`` and ``none``."""

from __future__ import annotations

import pytest

from megatron_rl.data.prompts import (
    KK_STYLE,
    KK_SYSTEM_PROMPT,
    MATH_STYLE,
    PLAIN_STYLE,
    prompt_style_for,
    render_prompt,
)
from megatron_rl.data.toy import build_toy_tokenizer

# Qwen2.5's chat template reduced to what a system + user conversation uses.
QWEN_LIKE_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

KK_LITERAL = (
    f"<|im_start|>system\n{KK_SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\nWho is who?<|im_end|>\n"
    "<|im_start|>assistant\n<think>"
)


@pytest.fixture(scope="module")
def chat_tokenizer():
    tokenizer = build_toy_tokenizer()
    tokenizer.chat_template = QWEN_LIKE_TEMPLATE
    return tokenizer


def test_literal_is_the_qwen_text():
    assert render_prompt("Who is who?", template="literal", style=KK_STYLE) == KK_LITERAL


def test_chat_uses_the_tokenizer_template(chat_tokenizer):
    text = render_prompt("Who is who?", template="chat", style=KK_STYLE, tokenizer=chat_tokenizer)
    assert text == KK_LITERAL  # a Qwen template gives exactly the literal text
    plain = render_prompt("Q", template="chat", style=PLAIN_STYLE, tokenizer=chat_tokenizer)
    assert plain == "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("tokenizer", [None, "toy"], ids=["no_tokenizer", "no_chat_template"])
def test_chat_falls_back_to_literal(tokenizer):
    tokenizer = build_toy_tokenizer() if tokenizer == "toy" else None
    assert render_prompt("Who is who?", template="chat", style=KK_STYLE, tokenizer=tokenizer) == KK_LITERAL


def test_none_is_the_raw_prompt(chat_tokenizer):
    assert render_prompt("copy 1 2 =", template="none", style=KK_STYLE, tokenizer=chat_tokenizer) == "copy 1 2 ="


def test_literal_without_system_prompt():
    assert render_prompt("Q", template="literal") == "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"


def test_styles_by_reward():
    assert prompt_style_for("kk_logic") is KK_STYLE and prompt_style_for("math") is MATH_STYLE
    assert prompt_style_for("my.module:fn") is PLAIN_STYLE
    # the K&K system prompt asks for exactly what kk_logic parses
    for piece in ("<think> </think>", "<answer> </answer>", "(1) Zoey is a knight\n(2) ..."):
        assert piece in KK_SYSTEM_PROMPT


def test_unknown_template():
    with pytest.raises(ValueError, match="unknown prompt template"):
        render_prompt("Q", template="jinja")
