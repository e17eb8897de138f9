"""The rollout engine interface: sampling parameters, completions, and the engine contract.

Every engine (``hf_engine.HFEngine`` on CPU or GPU, ``vllm_engine.VLLMEngine`` on GPU, and
any user engine named ``"package.module:Class"``) implements :class:`RolloutEngine`, so the
pool, the weight sync and the trainer never branch on the backend.

The contract, once, for every engine:

- **Prompts are token ids.** ``generate`` takes ``list[list[int]]``; templating and
  tokenisation happen before, in the data pipeline.
- **Log-probs are of the full distribution at the sampling temperature.** For a sampled
  token ``x`` at step ``t`` the engine reports ``log_softmax(logits_t / T)[x]`` over the
  whole vocabulary, *before* top-k / top-p truncation. Why: the trainer recomputes
  ``old_logp`` as ``log_softmax(actor_logits / T)`` over the full vocabulary (that is
  what the PPO ratio, AR weights and Lopti split use), so the engine must report the same
  quantity for the engine/actor mismatch metric and the TIS weights
  (``mismatch.py``) to measure numerical mismatch rather than a truncation artefact. With
  ``top_p = 1`` and ``top_k = -1`` (the RL default) this is also exactly the log-prob of
  the distribution the token was drawn from. ``temperature = 0`` means greedy decoding;
  its log-probs are reported at ``T = 1``.
- **Stop tokens are explicit.** Generation of a sample ends when it emits one of
  ``SamplingParams.stop_token_ids`` (finish reason ``"stop"``; the stop token is
  included in ``token_ids`` and has a log-prob, because the policy emitted it and the
  trainer must train on it) or after ``max_new_tokens`` tokens (``"length"``). Engines do
  NOT add the tokenizer's EOS on their own (vLLM runs with ``ignore_eos=True``): pass it
  in ``stop_token_ids``, so that both backends stop on exactly the same set.
- **Seeds are per prompt.** Prompt ``i`` of a call samples with ``prompt_seeds[i]`` (by
  default :func:`derive_seed` of ``SamplingParams.seed`` and ``i``); sample ``j`` of the
  prompt uses a stream derived from that seed and ``j``. The pool derives prompt seeds from
  the prompt's position in the *whole* request, so which engine serves a prompt, and
  which other prompts share its batch, does not change the random draws.
- **Weights are HF-named full tensors** (``model.layers.0.self_attn.q_proj.weight``), as
  ``save_pretrained`` writes them; the engine owns any re-layout (vLLM fuses q/k/v).
  ``update_weights`` may be called several times for one version (one call per bucket);
  the engine's ``weight_version`` becomes ``version`` and every completion is tagged with
  the version of the weights that produced it.
- **sleep / wake** release and restore accelerator memory for colocated placement.
  ``generate`` on a sleeping engine raises :class:`EngineAsleepError`; ``update_weights``
  is allowed while asleep (it is how colocated syncs run) and the new weights are in
  place after ``wake``.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import torch

from megatron_rl.config.rollout import RolloutConfig, SamplingSettings
from megatron_rl.configlib import require_range
from megatron_rl.seeding import derive_seed, prompt_seeds_for
from megatron_rl.weight_buckets import WeightBucket, unpack_bucket

FinishReason = Literal["stop", "length"]

__all__ = [
    "Completion",
    "EngineAsleepError",
    "FinishReason",
    "GenerateStats",
    "RolloutEngine",
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

    def __len__(self) -> int:
        return len(self.token_ids)


class EngineAsleepError(RuntimeError):
    """``generate`` was called on an engine that is asleep (call ``wake()`` first)."""


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


class RolloutEngine(abc.ABC):
    """One generation engine (one model replica). See the module docstring for the contract.

    Implementations are plain objects; ``pool.RolloutPool`` runs each inside a Ray actor.
    """

    name: str = "engine"
    """Human-readable name used in completions, logs and errors."""

    @abc.abstractmethod
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        prompt_seeds: Sequence[int] | None = None,
    ) -> list[list[Completion]]:
        """Sample ``params.n`` completions for each prompt.

        Args:
            prompts: ``P`` prompts, each a non-empty list of token ids.
            params: sampling settings shared by all prompts.
            prompt_seeds: ``P`` seeds, one per prompt; default
                ``prompt_seeds_for(params.seed, range(P))``.

        Returns:
            ``P`` lists (prompt order) of ``params.n`` completions (sample order).
        """

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> dict[str, int]:
        """Copy HF-named full tensors into the model; the engine's version becomes ``version``.

        May be called once per bucket of a sync. Unknown names or shapes raise.

        Returns:
            ``{"num_tensors": ..., "num_bytes": ...}`` loaded by this call.
        """

    def load_bucket(self, bucket: WeightBucket, version: int) -> dict[str, int]:
        """Load one bucket of a weight sync (:class:`~megatron_rl.weight_buckets.WeightBucket`).

        The default unpacks it into zero-copy views and calls :meth:`update_weights`; an
        engine with a faster path for the raw arrays may override it.
        """
        return self.update_weights(unpack_bucket(bucket), version)

    @abc.abstractmethod
    def sleep(self) -> None:
        """Release accelerator memory (weights and KV cache) for a colocated trainer."""

    @abc.abstractmethod
    def wake(self) -> None:
        """Restore what ``sleep`` released; a no-op when awake."""

    @property
    @abc.abstractmethod
    def weight_version(self) -> int:
        """Version of the weights now loaded (0 = the initial checkpoint)."""

    @property
    @abc.abstractmethod
    def sleeping(self) -> bool:
        """Whether the engine is asleep."""

    def health(self) -> dict[str, Any]:
        """A small status report; ``ok`` is False when the engine cannot serve requests."""
        return {
            "ok": True,
            "engine": self.name,
            "weight_version": self.weight_version,
            "sleeping": self.sleeping,
        }

    def shutdown(self) -> None:  # noqa: B027  (optional hook, empty by default)
        """Free resources before the process exits (optional)."""


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
