"""Prompt datasets: the K&K puzzle generator, the toy task, loaders and prompt templates.

- :mod:`~megatron_rl.data.kk`: Knights-and-Knaves puzzles with unique solutions, split
  into train/test per number of people.
- :mod:`~megatron_rl.data.toy`: the CPU demo's copy-the-digits task and its tokenizer.
- :mod:`~megatron_rl.data.loaders`: ``.jsonl`` / ``.parquet`` reading (errors name file,
  row and field) and writing.
- :mod:`~megatron_rl.data.prompts`: ``chat`` / ``literal`` / ``none`` prompt rendering.
- :mod:`~megatron_rl.data.cli`: ``megatron-rl generate-data``.

Nothing here imports torch; transformers is imported only to build the toy tokenizer.
See ``docs/data_and_rewards.md``.
"""

from megatron_rl.data.loaders import DataError, PromptRow, load_rows, parquet_available, write_jsonl, write_parquet
from megatron_rl.data.prompts import (
    KK_STYLE,
    KK_SYSTEM_PROMPT,
    PromptStyle,
    prompt_style_for,
    render_prompt,
)

__all__ = [
    "DataError",
    "KK_STYLE",
    "KK_SYSTEM_PROMPT",
    "PromptRow",
    "PromptStyle",
    "load_rows",
    "parquet_available",
    "prompt_style_for",
    "render_prompt",
    "write_jsonl",
    "write_parquet",
]
