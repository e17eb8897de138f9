"""Deterministic prompt order with a resumable cursor.

Epoch ``e`` visits the rows in a permutation seeded by ``(seed, e)`` (or in file order
without shuffling); the cursor ``(epoch, position)`` is all a checkpoint must store to
continue exactly where a run stopped.
"""

from __future__ import annotations

import random


class PromptSampler:
    """Hands out row indices ``num_prompts`` at a time, wrapping into new epochs."""

    def __init__(self, num_rows: int, *, seed: int, shuffle: bool = True):
        if num_rows < 1:
            raise ValueError("the training data has no rows")
        self.num_rows = num_rows
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(self.num_rows))
        if self.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def next_indices(self, num_prompts: int) -> list[int]:
        """The next ``num_prompts`` row indices (crossing into the next epoch as needed)."""
        out: list[int] = []
        while len(out) < num_prompts:
            if self.position == self.num_rows:
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
            take = min(num_prompts - len(out), self.num_rows - self.position)
            out.extend(self._order[self.position : self.position + take])
            self.position += take
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "num_rows": self.num_rows}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("num_rows") != self.num_rows:
            raise ValueError(
                f"the checkpoint's data cursor is for {state.get('num_rows')} rows but the training "
                f"data now has {self.num_rows}: resuming would not continue the same data order"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation(self.epoch)
