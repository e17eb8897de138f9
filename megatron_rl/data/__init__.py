"""Prompt datasets: loaders, the prompt templates and encoder, and the prompt order.

- :mod:`~megatron_rl.data.loaders`: ``.jsonl`` / ``.parquet`` reading (errors name file,
  row and field) and writing.
- :mod:`~megatron_rl.data.prompts`: ``chat`` / ``literal`` / ``none`` prompt rendering and
  :class:`PromptEncoder` (rendered texts and token ids of rows).
- :mod:`~megatron_rl.data.sampler`: the seeded, resumable prompt order.

What is particular to a task (its generator, prompt style and reward) lives in
:mod:`megatron_rl.tasks`, and ``megatron-rl generate-data`` in
:mod:`megatron_rl.cli.generate_data`; this package imports neither. Nothing here
imports torch. See ``docs/data_and_rewards.md``.
"""

from megatron_rl.data.loaders import (
    DataError,
    PromptRow,
    duplicate_ids,
    load_rows,
    parquet_available,
    write_jsonl,
    write_parquet,
)
from megatron_rl.data.prompts import PLAIN_STYLE, PromptEncoder, PromptStyle, render_prompt
from megatron_rl.data.sampler import PromptSampler

__all__ = [
    "DataError",
    "PLAIN_STYLE",
    "PromptEncoder",
    "PromptRow",
    "PromptSampler",
    "PromptStyle",
    "duplicate_ids",
    "load_rows",
    "parquet_available",
    "render_prompt",
    "write_jsonl",
    "write_parquet",
]
