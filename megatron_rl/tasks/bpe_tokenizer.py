"""A small byte-level BPE tokenizer trained on a task's generated rows, for models small
enough to train from scratch on CPU (``megatron-rl generate-data kk --tokenizer``; nothing
is downloaded).

It is trained on what such a model reads and writes: every row's prompt rendered with the
task's style in the literal ChatML template (``data.prompt_template: literal``, the
Qwen2.5 text) and, when present, its SFT ``response``. The special tokens (the first is
the end of sequence, which also pads) and the task's tags are single tokens; the tags are
not special, as Qwen3's ``<think>`` is not: decoding a response leaves out the special
tokens (``skip_special_tokens``, what the trainer does) and keeps the tags the reward
reads. Byte-level: any text encodes, and decoding gives the text back exactly, newlines
included, so a reward reads a generated response as the model wrote it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from megatron_rl.data.loaders import iter_records
from megatron_rl.data.prompts import PromptStyle, render_prompt

__all__ = ["rendered_texts", "train_bpe_tokenizer", "write_bpe_tokenizer"]


def rendered_texts(rows: Iterable[dict[str, Any]], style: PromptStyle) -> Iterable[str]:
    """What the tokenizer is trained on: each row's rendered prompt, then its response."""
    for row in rows:
        yield render_prompt(row["prompt"], template="literal", style=style)
        if isinstance(row.get("response"), str):
            yield row["response"]


def train_bpe_tokenizer(
    texts: Iterable[str], *, special_tokens: Sequence[str], vocab_size: int, tags: Sequence[str] = ()
) -> Any:
    """A ``transformers.PreTrainedTokenizerFast`` trained on ``texts`` (deterministic for the
    same texts in the same order); ``special_tokens`` then ``tags`` get ids 0, 1, ..., the
    first is EOS and padding. Tags are single tokens that decoding keeps (not special)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[*special_tokens, *tags], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    backend.train_from_iterator(list(texts), trainer=trainer)
    if tags:
        # The trainer keeps its tokens out of merges but makes them all special; the tags'
        # flag is cleared in the serialised form (re-adding them through ``add_tokens``
        # leaves them in the special set that ``decode`` skips).
        state = json.loads(backend.to_str())
        for token in state["added_tokens"]:
            token["special"] = token["content"] not in tags
        backend = Tokenizer.from_str(json.dumps(state))
    eos = special_tokens[0]
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eos, pad_token=eos, model_max_length=4096)


def write_bpe_tokenizer(
    directory: str | os.PathLike, rows_file: str | os.PathLike, *, style: PromptStyle, special_tokens: Sequence[str],
    vocab_size: int, tags: Sequence[str] = (),
) -> Path:
    """Train on ``rows_file``'s rows (a generated ``train.jsonl``) and save to ``directory``
    (loadable with ``AutoTokenizer.from_pretrained``)."""
    rows = [record for _, record in iter_records(rows_file)]
    tokenizer = train_bpe_tokenizer(rendered_texts(rows, style), special_tokens=special_tokens, vocab_size=vocab_size,
                                    tags=tags)  # fmt: skip
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(directory))
    return directory
