"""Every seed of a run derived from ``trainer.seed`` in one place, stable across processes.

A run is reproducible (and resumable to the same numbers) because each random stream
depends only on the base seed and named keys, never on the process, the number of
engines or the order of calls: the rollout of step ``k``, the mini-batch split of an
update pass, the evaluation of step ``k``, and each prompt and sample of a request.
The salts below keep those streams apart.
"""

from __future__ import annotations

import hashlib
import secrets
import struct
from collections.abc import Iterable

__all__ = [
    "EVAL_SALT",
    "MINIBATCH_SALT_PER_PASS",
    "derive_seed",
    "eval_seed",
    "minibatch_seed",
    "prompt_seeds_for",
    "rollout_seed",
]

_SEED_MASK = (1 << 63) - 1

MINIBATCH_SALT_PER_PASS = 7919
"""Mini-batch splits of update pass ``p``, epoch ``e`` use key ``MINIBATCH_SALT_PER_PASS * p + e``
(a prime larger than any epoch count, so passes and epochs never share a key)."""

EVAL_SALT = 104729
"""Key of the evaluation's sampling stream (apart from the rollout stream of the same step)."""


def derive_seed(base: int, *keys: int) -> int:
    """A 63-bit seed that depends on ``base`` and ``keys`` only (stable across processes).

    Python's ``hash`` is salted per process for str/bytes, so a keyed BLAKE2 digest is
    used instead; any change of ``base`` or of a key gives an unrelated stream.
    """
    payload = struct.pack(f"<{1 + len(keys)}q", base & _SEED_MASK, *(k & _SEED_MASK for k in keys))
    return int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "little") & _SEED_MASK


def prompt_seeds_for(seed: int | None, indices: Iterable[int]) -> list[int]:
    """Per-prompt seeds for prompts at positions ``indices`` of a request.

    ``seed=None`` draws a fresh base seed from the OS, so repeated calls differ.
    """
    if seed is None:
        seed = secrets.randbits(63)
    return [derive_seed(seed, i) for i in indices]


def rollout_seed(base: int, step: int) -> int:
    """Base sampling seed of the rollout of RL step ``step``."""
    return derive_seed(base, step)


def minibatch_seed(base: int, step: int, pass_index: int, epoch: int) -> int:
    """Seed of the mini-batch split of update pass ``pass_index``, epoch ``epoch`` of step ``step``."""
    return derive_seed(base, step, MINIBATCH_SALT_PER_PASS * pass_index + epoch)


def eval_seed(base: int, step: int) -> int:
    """Base sampling seed of the evaluation after step ``step``."""
    return derive_seed(base, step, EVAL_SALT)
