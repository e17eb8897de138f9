"""The run's prompts: training rows in a resumable seeded order and the eval rows,
rendered and tokenised, with the stop and pad ids of the tokenizer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megatron_rl.data.loaders import PromptRow
from megatron_rl.data.prompts import PromptEncoder
from megatron_rl.data.sampler import PromptSampler

__all__ = ["EncodedPrompts", "PromptSource"]


@dataclass(frozen=True)
class EncodedPrompts:
    """Data rows with the text the model sees and its token ids (same order)."""

    rows: list[PromptRow]
    texts: list[str]
    token_ids: list[list[int]]

    def __len__(self) -> int:
        return len(self.rows)


class PromptSource:
    """Training prompts drawn in a seeded order that survives a resume, and the eval prompts.

    Args:
        train_rows: the training rows (``data.train_files``).
        eval_rows: the eval rows (``data.eval_files``), possibly empty.
        encoder: renders and tokenises rows (a prompt too long is a ``DataError`` naming
            its file and row).
        seed: seed of the training order (``trainer.seed``).
        shuffle: shuffle the training rows each pass over the data.
    """

    def __init__(
        self,
        train_rows: Sequence[PromptRow],
        eval_rows: Sequence[PromptRow],
        *,
        encoder: PromptEncoder,
        seed: int,
        shuffle: bool,
    ):
        self.train_rows = list(train_rows)
        self.eval_rows = list(eval_rows)
        self.encoder = encoder
        self.sampler = PromptSampler(len(self.train_rows), seed=seed, shuffle=shuffle)
        tokenizer = encoder.tokenizer
        self.stop_token_ids: tuple[int, ...] = tuple(t for t in {tokenizer.eos_token_id} if t is not None)
        """Tokens that end a response: the tokenizer's EOS (engines add none on their own)."""
        pad = tokenizer.pad_token_id
        self.pad_id: int = int(pad if pad is not None else (self.stop_token_ids[0] if self.stop_token_ids else 0))
        """Id written into batch padding (never trained on)."""

    def next_prompts(self, num_prompts: int) -> EncodedPrompts:
        """The next ``num_prompts`` training prompts (advances the order)."""
        rows = [self.train_rows[i] for i in self.sampler.next_indices(num_prompts)]
        return self._encode(rows)

    def eval_prompts(self) -> EncodedPrompts:
        """All eval prompts, in file order."""
        return self._encode(self.eval_rows)

    def decode(self, token_ids: Sequence[int]) -> str:
        """A response's text (special tokens dropped), as the reward sees it."""
        return self.encoder.decode(token_ids)

    def _encode(self, rows: list[PromptRow]) -> EncodedPrompts:
        texts, ids = self.encoder.encode(rows)
        return EncodedPrompts(rows=rows, texts=texts, token_ids=ids)

    def state_dict(self) -> dict[str, Any]:
        """The position in the training order (saved in every checkpoint)."""
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)
