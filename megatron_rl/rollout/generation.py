"""What a generation call takes and returns, for every engine and pool: sampling
parameters, completions, prompt checks and an engine's counters.

The log-prob, stop-token and seed rules these types carry are the engine contract's
(:mod:`megatron_rl.rollout.engines.base`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Literal

from megatron_rl.config.lib import require_range
from megatron_rl.config.rollout import RolloutConfig, SamplingSettings
from megatron_rl.config.seeding import derive_seed, prompt_seeds_for

if TYPE_CHECKING:
    import torch

FinishReason = Literal["stop", "length"]

__all__ = [
    "Completion",
    "FinishReason",
    "GenerateStats",
    "SamplingParams",
    "check_prompts",
    "derive_seed",
    "prompt_seeds_for",
]


@dataclass(kw_only=True)
class SamplingParams(SamplingSettings):
    """How to sample completions; one value for every prompt of a ``generate`` call.

    The sampling settings themselves (temperature, top-p, top-k, max new tokens) are
    declared once in :class:`~megatron_rl.config.rollout.SamplingSettings`, which the
    run's ``rollout`` section extends too; this request adds the group size, the stop
    tokens and the seed. Treat an instance as immutable (``dataclasses.replace`` makes
    variants, as the evaluation does).
    """

    n: int = 1
    """Completions per prompt (the GRPO group size); they are returned together."""

    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end a completion (finish reason ``"stop"``); the stop token is kept in
    the output. The tokenizer's EOS is not added implicitly: list it here."""

    seed: int | None = None
    """Base seed; prompt ``i`` of the request samples from ``derive_seed(seed, i)``.
    ``None`` draws a fresh seed per call (not reproducible)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require_range("n", self.n, ge=1)
        # Accept any iterable of ints (a list from YAML, a tokenizer's eos list) but store a
        # tuple so the stop set cannot change under an engine.
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        """Whether this is greedy decoding (``temperature == 0``)."""
        return self.temperature == 0.0

    @classmethod
    def from_rollout_config(
        cls, rollout: RolloutConfig, *, seed: int | None, stop_token_ids: Sequence[int] = ()
    ) -> SamplingParams:
        """The sampling settings of ``rollout`` (n = ``num_samples_per_prompt``)."""
        settings = {f.name: getattr(rollout, f.name) for f in fields(SamplingSettings)}
        return cls(**settings, n=rollout.num_samples_per_prompt, stop_token_ids=tuple(stop_token_ids), seed=seed)


@dataclass(kw_only=True)
class Completion:
    """One sampled completion of one prompt.

    ``token_ids`` and ``logprobs`` have the same length ``L`` (1 <= L <= max_new_tokens);
    ``logprobs[t] = log_softmax(logits_t / T)[token_ids[t]]`` over the full vocabulary
    (see the module docstring), float32 precision.
    """

    token_ids: list[int]
    """Generated token ids (prompt excluded; a final stop token included)."""

    logprobs: list[float]
    """Log-prob of each generated token under the engine's weights at the sampling
    temperature, before top-k/top-p truncation."""

    finish_reason: FinishReason
    """``"stop"``: ended on a stop token; ``"length"``: reached ``max_new_tokens``."""

    weight_version: int
    """Version of the weights that generated this completion (0 = the initial checkpoint)."""

    engine: str = ""
    """Name of the engine that generated it (for logs and failure reports)."""

    routed_experts: torch.Tensor | None = None
    """With ``rollout.routing_replay`` on a mixture-of-experts model: ``[P + L - 1, M, k]``
    int16, the ``k`` experts each of the model's ``M`` MoE layers routed each token the
    engine ran to: the ``P`` prompt tokens, then the generated ones but the last (never
    fed to the model); else ``None``."""

    def __len__(self) -> int:
        return len(self.token_ids)


def check_prompts(prompts: Sequence[Sequence[int]], *, vocab_size: int | None = None) -> None:
    """Raise ``ValueError`` naming the prompt index for an empty prompt or an id out of range."""
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty; a prompt needs at least one token")
        if vocab_size is not None:
            lo, hi = min(prompt), max(prompt)
            if lo < 0 or hi >= vocab_size:
                bad = lo if lo < 0 else hi
                raise ValueError(f"prompt {i} has token id {bad} outside the vocabulary [0, {vocab_size})")


@dataclass(kw_only=True)
class GenerateStats:
    """Counters an engine may keep about its own work (reported by ``health``)."""

    num_requests: int = 0
    """``generate`` calls served."""

    num_completions: int = 0
    """Completions returned."""

    num_generated_tokens: int = 0
    """Tokens generated (sum of completion lengths)."""

    extra: dict[str, float] = field(default_factory=dict)
    """Backend-specific counters."""

    def add(self, results: Sequence[Sequence[Completion]]) -> None:
        """Count one ``generate`` call's results."""
        self.num_requests += 1
        for group in results:
            self.num_completions += len(group)
            self.num_generated_tokens += sum(len(c) for c in group)
