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
  ``save_pretrained`` writes them, in the dtype the engine loads
  (:meth:`RolloutEngine.expected_weights`); the engine owns any re-layout (vLLM fuses
  q/k/v). A weight update is one *version*, the whole model:
  :meth:`~RolloutEngine.begin_weight_update` checks its metadata before anything moves
  (an unknown name, a wrong shape or dtype, a missing tensor raise
  :class:`~megatron_rl.weight_transfer.WeightUpdateError` naming the engine and the
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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

import torch

from megatron_rl.config.rollout import RolloutConfig, SamplingSettings
from megatron_rl.configlib import require_range
from megatron_rl.seeding import derive_seed, prompt_seeds_for
from megatron_rl.weight_buckets import WeightBucket, unpack_bucket
from megatron_rl.weight_transfer.meta import TensorMeta, check_update, dtype_of

FinishReason = Literal["stop", "length"]

__all__ = [
    "Completion",
    "EngineAsleepError",
    "EngineWeightsInvalidError",
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


class EngineWeightsInvalidError(RuntimeError):
    """``generate`` was called on an engine whose last weight update failed half-way."""


def checkpoint_tensors(model_path: str | Path, dtype: torch.dtype) -> dict[str, TensorMeta]:
    """``{HF name: TensorMeta}`` of the weights in the HF directory ``model_path`` (read
    from the safetensors headers, no data), in ``dtype``: what a sync into an engine
    started from that directory must carry. Tensors that hold no weights of their own
    (RoPE ``inv_freq`` buffers, a tied checkpoint's copy of the embedding) are left out."""
    from megatron_rl.models import ConversionError, adapter_for_config
    from megatron_rl.models.hf_io import SafetensorsReader, read_config

    config = read_config(Path(model_path))
    try:
        ignorable = adapter_for_config(config).ignorable_hf_names(config)
    except ConversionError:  # an architecture without an adapter: every tensor counts
        ignorable = lambda name: False  # noqa: E731
    dtype_name = str(dtype).removeprefix("torch.")
    return {
        name: TensorMeta(name, dtype_name if spec.dtype.is_floating_point else str(spec.dtype).removeprefix("torch."),
                         tuple(spec.shape))  # fmt: skip
        for name, spec in SafetensorsReader.open(Path(model_path)).entries.items()
        if not ignorable(name)
    }


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

    # ------------------------------------------------------------------ weights
    #
    # Engines implement the hooks (``expected_weights``, ``_load_host`` and, to join a
    # transfer group, ``_join_transfer`` / ``_receive``; optionally ``_start_update`` /
    # ``_finish_update``); the public methods below keep the contract's checks and
    # state in one place. Class-level defaults stand in for state until first set.

    weight_backends: tuple[str, ...] = ("object_store",)
    """Transfer backends this engine receives through (``object_store``: host tensors via
    :meth:`load_weights`; ``gloo``, ``nccl``, ``ipc``: a sender's transfer group)."""

    _version: int = 0
    _update_version: int | None = None
    _update_touched: bool = False
    _weights_ok: bool = True
    _dequantizer: Any = None  # a ``weight_transfer.fp8.Dequantizer`` while an FP8 update is open

    tensor_parallel: bool = False
    """Whether the engine takes a ``tensor_parallel_size`` argument (``rollout.tensor_parallel_size``)."""

    weight_formats: tuple[str, ...] = ("auto",)
    """Wire formats this engine reads (``rollout.weight_dtype``): ``auto`` (its own dtype)
    and, where supported, ``fp8`` (``weight_transfer.fp8``)."""

    weight_format: str = "auto"
    """The wire format of this engine's updates (:meth:`set_weight_format`)."""

    def set_weight_format(self, fmt: str) -> None:
        """Receive updates in wire format ``fmt`` from now on (one of :attr:`weight_formats`)."""
        if fmt not in self.weight_formats:
            raise ValueError(f"{self.name}: weight format {fmt!r} is not one of {self.weight_formats}")
        self.weight_format = fmt

    def wire_weights(self) -> dict[str, TensorMeta]:
        """What an update carries on the wire: :meth:`expected_weights`, in FP8 form
        (each projection weight plus its block scales) when the format is ``fp8``."""
        if self.weight_format != "fp8":
            return self.expected_weights()
        from megatron_rl.weight_transfer.fp8 import wire_metas

        return {m.name: m for m in wire_metas(self.expected_weights().values())}

    def _load_wire(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Load wire tensors: FP8 ones dequantized to the engine's dtype first."""
        if self._dequantizer is not None:
            named_tensors = self._dequantizer.feed(named_tensors)
        if named_tensors:
            self._load_host(named_tensors)

    @classmethod
    def weight_transfer_args(cls, backend: str) -> dict[str, Any]:
        """Extra constructor arguments an engine needs to receive through ``backend``
        (vLLM fixes its weight-transfer backend at start-up); default none."""
        return {}

    @property
    def weight_receivers(self) -> int:
        """Processes of this engine that join a transfer group (vLLM: one per worker)."""
        return 1

    @abc.abstractmethod
    def expected_weights(self) -> dict[str, TensorMeta]:
        """``{HF name: TensorMeta}`` of every tensor a weight update carries, in the dtype
        the engine loads (a sync sends exactly these)."""

    @abc.abstractmethod
    def _load_host(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Load host tensors of the open update (names and shapes already checked)."""

    def _start_update(self) -> None:  # noqa: B027  (optional hook)
        """Prepare the model for an update (vLLM: layerwise reload)."""

    def _finish_update(self, version: int | None) -> None:  # noqa: B027  (optional hook)
        """Complete the update (vLLM: rebuild the layers that received tensors); ``None``
        when it is aborted."""

    def _join_transfer(self, init_info: dict[str, Any]) -> None:
        raise NotImplementedError(f"{self.name} cannot join a weight-transfer group (backends {self.weight_backends})")

    def _receive(self, update_info: dict[str, Any]) -> None:
        raise NotImplementedError(f"{self.name} cannot receive from a weight-transfer group")

    @property
    def weight_version(self) -> int:
        """Version of the weights now loaded (0 = the initial checkpoint)."""
        return self._version

    @property
    def weight_dtype(self) -> str:
        """The dtype the engine loads its floating-point weights in (``"bfloat16"``)."""
        return next((m.dtype for m in self.expected_weights().values() if dtype_of(m.dtype).is_floating_point), "")

    def begin_weight_update(self, version: int, metas: Sequence[TensorMeta]) -> None:
        """Open the update to ``version``, whose tensors are ``metas`` (the whole model).

        Raises :class:`~megatron_rl.weight_transfer.WeightUpdateError` (names the engine,
        the tensor and the version) when they do not fit the model; nothing changes then.
        """
        if self._update_version is not None:
            raise RuntimeError(f"{self.name}: an update to version {self._update_version} is still open")
        check_update(self.wire_weights(), metas, engine=self.name, version=int(version), require_all=True)
        self._start_update()
        self._update_version, self._update_touched = int(version), False
        if self.weight_format == "fp8":
            from megatron_rl.weight_transfer.fp8 import Dequantizer

            self._dequantizer = Dequantizer(dtype_of(self.weight_dtype))

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, int]:
        """Load host tensors of the open update (any number of calls, e.g. one per bucket).

        Returns ``{"num_tensors": ..., "num_bytes": ...}`` loaded by this call.
        """
        self._require_update("load_weights")
        named = list(named_tensors)
        check_update(self.wire_weights(), [TensorMeta.of(n, t) for n, t in named], engine=self.name,
                     version=self._update_version, require_all=False)  # fmt: skip
        self._touch()
        self._load_wire(named)
        return {"num_tensors": len(named), "num_bytes": sum(t.numel() * t.element_size() for _, t in named)}

    def load_bucket(self, bucket: WeightBucket) -> dict[str, int]:
        """:meth:`load_weights` of one :class:`~megatron_rl.weight_buckets.WeightBucket`
        (zero-copy views of its arrays)."""
        return self.load_weights(unpack_bucket(bucket))

    def init_weight_transfer(self, init_info: dict[str, Any]) -> None:
        """Join a sender's transfer group (once per group; see ``weight_transfer``)."""
        self._join_transfer(init_info)

    def receive_weights(self, update_info: dict[str, Any]) -> None:
        """Receive the open update's tensors from the transfer group (blocks until done)."""
        self._require_update("receive_weights")
        self._touch()
        self._receive(update_info)

    def commit_weight_update(self) -> int:
        """Close the open update: its version becomes current; returns it."""
        version = self._require_update("commit_weight_update")
        if self._dequantizer is not None:
            self._dequantizer, dequantizer = None, self._dequantizer
            dequantizer.finish()  # raises if a weight lacks its scales: the caller aborts
        self._finish_update(version)
        self._version, self._update_version, self._weights_ok = version, None, True
        return version

    def abort_weight_update(self) -> None:
        """Close a failed update. If tensors had started to arrive the engine keeps a mix of
        versions and reports ``ok: False`` until a later update commits; otherwise it
        keeps its weights, as they were."""
        if self._update_version is None:
            return
        self._update_version, self._dequantizer = None, None
        try:
            self._finish_update(None)
        except Exception:
            self._weights_ok = False  # the model may be half torn down

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> dict[str, int]:
        """A whole update in one call: ``named_tensors`` (the whole model, any float dtype:
        converted to the engine's) become ``version``.

        Returns ``{"num_tensors": ..., "num_bytes": ...}`` as loaded.
        """
        expected = self.expected_weights()
        named = []
        for name, tensor in named_tensors:
            want = expected.get(name)
            if want is not None and tensor.dtype != dtype_of(want.dtype) and tensor.is_floating_point():
                tensor = tensor.to(dtype_of(want.dtype))
            named.append((name, tensor))
        if self.weight_format == "fp8":
            from megatron_rl.weight_transfer.fp8 import Fp8Source

            named = list(Fp8Source(_ListSource(named)))
        self.begin_weight_update(version, [TensorMeta.of(n, t) for n, t in named])
        try:
            stats = self.load_weights(named)
        except BaseException:
            self.abort_weight_update()
            raise
        self.commit_weight_update()
        return stats

    def _touch(self) -> None:
        """Data is about to move: until the commit, a failure leaves mixed weights."""
        self._update_touched, self._weights_ok = True, False

    def _require_update(self, method: str) -> int:
        if self._update_version is None:
            raise RuntimeError(f"{self.name}: {method}() outside a weight update (call begin_weight_update first)")
        return self._update_version

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


class _ListSource(list):
    """``(name, tensor)`` pairs as a weight source (``metadata()`` + iteration)."""

    def metadata(self) -> list[TensorMeta]:
        return [TensorMeta.of(n, t) for n, t in self]


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
