"""The rollout engine interface: sampling parameters, completions, and the engine contract.

Every engine (``engines.hf.HFEngine`` on CPU or GPU, ``engines.vllm.VLLMEngine`` on GPU, and
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
  ``save_pretrained`` writes them, in the dtype the engine loads
  (:meth:`RolloutEngine.expected_weights`); the engine owns any re-layout (vLLM fuses
  q/k/v). A weight update is one *version*, the whole model:
  :meth:`~RolloutEngine.begin_weight_update` checks its metadata before anything moves
  (an unknown name, a wrong shape or dtype, a missing tensor raise
  :class:`~megatron_rl.weight_sync.WeightUpdateError` naming the engine and the
  version, and the engine keeps its weights); the tensors then arrive as host tensors
  (:meth:`~RolloutEngine.load_weights`, once per bucket) or through a transfer group
  (:meth:`~RolloutEngine.init_weight_transfer` once, :meth:`~RolloutEngine.receive_weights`);
  :meth:`~RolloutEngine.commit_weight_update` makes ``version`` current. An engine whose
  update failed after data started moving holds a mix of versions: it reports
  ``ok: False`` and refuses to generate until a full update commits (the pool restarts
  it). Every completion is tagged with the version of the weights that produced it.
- **sleep / wake** release and restore accelerator memory for colocated placement.
  ``generate`` on a sleeping engine raises :class:`EngineAsleepError`; weight updates
  are allowed while asleep (a colocated sync wakes the weights alone) and the new weights
  are in place after ``wake``.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

from megatron_rl.rollout.generation import Completion, SamplingParams
from megatron_rl.weight_sync.adapters import AdapterUpdate
from megatron_rl.weight_sync.receiver import WeightReceiver

__all__ = ["EngineAsleepError", "EngineWeightsInvalidError", "RolloutEngine"]


class EngineAsleepError(RuntimeError):
    """``generate`` was called on an engine that is asleep (call ``wake()`` first)."""


class EngineWeightsInvalidError(RuntimeError):
    """``generate`` was called on an engine whose last weight update failed half-way."""


class RolloutEngine(WeightReceiver):
    """One generation engine (one model replica). See the module docstring for the contract.

    Implementations are plain objects; ``pool.RolloutPool`` runs each inside a Ray actor.
    """

    name: str = "engine"
    """Human-readable name used in completions, logs and errors."""

    tensor_parallel: bool = False
    """Whether the engine takes a ``tensor_parallel_size`` argument (``rollout.tensor_parallel_size``)."""

    routed_experts: bool = False
    """Whether the engine takes a ``return_routed_experts=True`` argument and then fills
    each completion's ``routed_experts`` (``rollout.routing_replay``)."""

    lora_adapters: bool = False
    """Whether the engine takes a ``lora_rank=r`` argument and then loads the actor's LoRA
    adapters at each version (:meth:`load_adapter`; ``rollout.lora_sync: adapter``)."""

    own_process: bool = False
    """Whether the engine takes an ``own_process=True`` argument: the process is the engine's
    alone (a pool's Ray actor, ``rollout.pool.worker``), so the engine may put process-wide
    state there (vLLM's worker, on CPU)."""

    def load_adapter(self, version: int, update: AdapterUpdate) -> int:
        """Generate with the actor's LoRA adapters ``update`` (``weight_sync.adapters``) over the
        base weights the engine holds, from now on; ``version`` becomes the engine's version
        (returned). Refused while a weight update is open or after one failed half-way (the
        base is then a mix of versions)."""
        if not self.lora_adapters:
            raise NotImplementedError(f"{self.name} loads no LoRA adapters (rollout.lora_sync: merged)")
        if self._update_version is not None:
            raise RuntimeError(f"{self.name}: load_adapter() while the update to version {self._update_version} "
                               "is open")  # fmt: skip
        if not self._weights_ok:
            raise EngineWeightsInvalidError(f"{self.name}: its base weights are a mix of versions; a full update "
                                            "must commit before adapters load")  # fmt: skip
        self._load_adapter(update)
        self._version = int(version)
        return self._version

    def _load_adapter(self, update: AdapterUpdate) -> None:
        raise NotImplementedError

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

    def _check_can_generate(self) -> None:
        if self.sleeping:
            raise EngineAsleepError(f"{self.name}: generate() called while asleep; call wake() first")
        if not self._weights_ok:
            raise EngineWeightsInvalidError(
                f"{self.name}: its last weight update did not complete; it holds a mix of versions"
            )

    @abc.abstractmethod
    def sleep(self) -> None:
        """Release accelerator memory (weights and KV cache) for a colocated trainer."""

    @abc.abstractmethod
    def wake(self) -> None:
        """Restore what ``sleep`` released; a no-op when awake."""

    @property
    @abc.abstractmethod
    def sleeping(self) -> bool:
        """Whether the engine is asleep."""

    def health(self) -> dict[str, Any]:
        """A small status report; ``ok`` is False when the engine cannot serve requests."""
        return {
            "ok": self._weights_ok,
            "engine": self.name,
            "weight_version": self.weight_version,
            "sleeping": self.sleeping,
            "weight_receivers": self.weight_receivers,
            "weight_dtype": self.weight_dtype,
            "weight_format": self.weight_format,
        }

    def shutdown(self) -> None:  # noqa: B027  (optional hook, empty by default)
        """Free resources before the process exits (optional)."""


