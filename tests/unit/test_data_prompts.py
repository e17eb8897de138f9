"""Prompt rendering (``chat`` (tokenizer template, else literal), ``literal``, ``none``) and ``PromptEncoder``."""

from __future__ import annotations

import pytest

from megatron_rl.data.loaders import DataError, PromptRow
from megatron_rl.data.prompts import PLAIN_STYLE, PromptEncoder, render_prompt, tokenize
from megatron_rl.tasks.kk import KK_STYLE, KK_SYSTEM_PROMPT
from megatron_rl.tasks.toy import build_toy_tokenizer

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


def test_unknown_template():
    with pytest.raises(ValueError, match="unknown prompt template"):
        render_prompt("Q", template="jinja")


# --------------------------------------------------------------------------- PromptEncoder


def _row(prompt: str, row: int = 1) -> PromptRow:
    return PromptRow(prompt=prompt, ground_truth="1 2", file="data/toy.jsonl", row=row)


def _encoder(tokenizer, *, template="none", style=PLAIN_STYLE, max_prompt_tokens=8) -> PromptEncoder:
    return PromptEncoder(tokenizer, template=template, style=style, max_prompt_tokens=max_prompt_tokens)


def test_encoder_renders_and_tokenises_each_row():
    tokenizer = build_toy_tokenizer()
    texts, ids = _encoder(tokenizer).encode([_row("copy 1 2 ="), _row("copy 3 =", row=2)])
    assert texts == ["copy 1 2 =", "copy 3 ="]
    assert ids == [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    assert ids[1] == [3, 8, 4]  # copy, 3, = (no special tokens added)


def test_encoder_uses_the_template_and_style(chat_tokenizer):
    encoder = _encoder(chat_tokenizer, template="chat", style=KK_STYLE, max_prompt_tokens=10_000)
    texts, ids = encoder.encode([_row("Who is who?")])
    assert texts == [render_prompt("Who is who?", template="chat", style=KK_STYLE, tokenizer=chat_tokenizer)]
    assert ids == [chat_tokenizer.encode(texts[0], add_special_tokens=False)]


def test_encoder_accepts_exactly_max_prompt_tokens():
    _, ids = _encoder(build_toy_tokenizer(), max_prompt_tokens=4).encode([_row("copy 1 2 =")])
    assert len(ids[0]) == 4


def test_encoder_rejects_a_prompt_longer_than_the_limit():
    with pytest.raises(DataError) as err:
        _encoder(build_toy_tokenizer(), max_prompt_tokens=3).encode(
            [_row("copy 1 =", row=1), _row("copy 1 2 =", row=7)]
        )
    assert (err.value.file, err.value.row, err.value.field) == ("data/toy.jsonl", 7, "prompt")
    assert str(err.value) == (
        "data/toy.jsonl, row 7, field 'prompt': the prompt has 4 tokens, more than rollout.max_prompt_tokens=3"
    )


def test_encoder_rejects_a_prompt_empty_after_tokenisation():
    with pytest.raises(DataError) as err:
        _encoder(build_toy_tokenizer()).encode([_row("  ", row=3)])
    assert (err.value.row, err.value.field) == (3, "prompt")
    assert str(err.value).endswith("the prompt is empty after tokenisation")


def test_encoder_decode_skips_special_tokens():
    tokenizer = build_toy_tokenizer()
    ids = tokenizer.encode("3 1 4 <eos> <pad>", add_special_tokens=False)
    assert _encoder(tokenizer).decode(tuple(ids)) == "3 1 4"


def test_check_tokenises_every_row_and_names_the_first_bad_one():
    rows = [_row("copy 1 2 =", row=1), _row("copy 1 2 3 4 5 6 =", row=2), _row("copy 9 9 9 9 9 9 =", row=7)]
    encoder = _encoder(build_toy_tokenizer(), max_prompt_tokens=6)
    with pytest.raises(DataError) as err:
        encoder.check(rows)
    assert err.value.row == 2 and "more than rollout.max_prompt_tokens=6" in str(err.value)
    assert "1 more bad prompt(s)" in str(err.value) and "row 7" in str(err.value)
    encoder.check(rows[:1])  # a good row passes
    assert tokenize(encoder.tokenizer, ["copy 1 2 ="]) == encoder.encode(rows[:1])[1]  # the batched ids are encode's
