"""A vLLM rollout engine (GPU) behind the :class:`RolloutEngine` interface.

Pinned to vLLM 0.11 (V1 engine), public API only; ``vllm`` is imported when the engine
is constructed, never at module import, so CPU machines can import this module.

- Engine: ``vllm.LLM(model=path, **engine_args)`` with these defaults (overridable, except
  ``logprobs_mode`` and ``worker_extension_cls``, which the contract needs):
  ``enable_sleep_mode=True`` (colocated placement), ``skip_tokenizer_init=True`` (prompts
  and outputs are token ids), ``logprobs_mode="processed_logprobs"``. Tensor parallelism is
  ``tensor_parallel_size`` in ``engine_args``; the pool gives the actor that many GPUs
  (``megatron_rl.placement``) and vLLM's default multiprocessing executor
  spreads the shards over them.
- Log-probs: ``processed_logprobs`` are ``log_softmax`` of the logits after temperature
  (and after top-k/top-p); ``raw_logprobs`` (vLLM's default) would be at temperature 1.
  So with ``top_p = 1, top_k = -1`` (the RL default) the reported log-prob is exactly
  the contract's ``log_softmax(logits / T)`` over the full vocabulary. With top-k/top-p
  on, vLLM exposes only the log-prob *renormalised over the kept tokens*
  (``>=`` the contract's value by ``-log(kept mass)``); the engine warns once, and the
  mismatch metric shows the gap. Greedy (T = 0) reports T = 1 log-probs, as the contract.
- Sampling: one ``vllm.SamplingParams`` per prompt with ``seed = prompt_seeds[i]``,
  ``ignore_eos=True`` (stop only on ``stop_token_ids``), ``logprobs=0`` (just the sampled
  token), ``detokenize=False``.
- Weights: in place, through a worker extension (``worker_extension_cls``) called with
  ``LLM.collective_rpc``: each bucket's HF-named host tensors go to every TP worker,
  which moves them to its GPU and calls the model's own ``load_weights`` (which fuses
  q/k/v and gate/up and keeps its TP rank's shard). The prefix cache is reset before the
  next generation, since cached KV blocks were computed with the old weights.
- Sleep: ``LLM.sleep(level=sleep_level)`` (1: weights to host memory, KV cache dropped;
  2: both dropped -- only safe when every sync carries the whole model, which the pool
  requires). ``update_weights`` while asleep first wakes the weights alone
  (``wake_up(tags=["weights"])``) so a colocated sync never holds the KV cache;
  ``wake`` then restores the KV cache.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from megatron_rl.models.hf_io import read_config
from megatron_rl.rollout.base import (
    Completion,
    EngineAsleepError,
    GenerateStats,
    RolloutEngine,
    SamplingParams,
    check_prompts,
    prompt_seeds_for,
)

__all__ = ["VLLMEngine", "WeightLoaderExtension"]

logger = logging.getLogger(__name__)

_EXTENSION = f"{__name__}.WeightLoaderExtension"
_ENGINE_DEFAULTS = {"enable_sleep_mode": True, "skip_tokenizer_init": True}


class WeightLoaderExtension:
    """Mixed into every vLLM worker (``worker_extension_cls``); called via ``collective_rpc``.

    ``self`` is the vLLM GPU worker: ``self.device`` and ``self.model_runner.model`` are
    its device and model (the attributes vLLM's own RLHF examples use).
    """

    def megatron_rl_load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Load HF-named full host tensors into this worker's model; returns the tensor count."""
        weights = [(name, tensor.to(self.device, non_blocking=True)) for name, tensor in named_tensors]
        self.model_runner.model.load_weights(weights=weights)
        torch.cuda.synchronize()
        return len(weights)


class VLLMEngine(RolloutEngine):
    """Rollout engine over ``vllm.LLM``.

    Args:
        model_path: HF model directory.
        name: engine name used in completions and errors.
        sleep_level: vLLM sleep level used by ``sleep()`` (1 or 2).
        **engine_args: ``vllm.LLM`` / ``EngineArgs`` keyword arguments, passed unchanged.
    """

    def __init__(self, model_path: str | Path, *, name: str = "vllm", sleep_level: int = 1, **engine_args: Any):
        try:
            import vllm
        except ImportError as exc:  # a clear message instead of a bare ModuleNotFoundError
            raise ImportError(
                "rollout.engine 'vllm' needs vLLM (CUDA only): pip install -e '.[gpu]'; "
                "use rollout.engine 'hf' on CPU"
            ) from exc
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level: got {sleep_level}; vLLM supports 1 or 2")
        for key, required in (("logprobs_mode", "processed_logprobs"), ("worker_extension_cls", _EXTENSION)):
            if engine_args.get(key, required) != required:
                raise ValueError(
                    f"engine_args.{key}={engine_args[key]!r} is not supported: the engine needs {required!r}"
                )
        args = {**_ENGINE_DEFAULTS, **engine_args}
        args.update(logprobs_mode="processed_logprobs", worker_extension_cls=_EXTENSION)
        self.name = name
        self.model_path = str(model_path)
        self.sleep_level = sleep_level
        self.llm = vllm.LLM(model=self.model_path, **args)
        self._vllm = vllm
        self._version = 0
        self._sleeping = False
        self._weights_awake = True
        self._prefix_cache_stale = False
        self._warned_truncation = False
        self.stats = GenerateStats()
        # From config.json rather than vLLM internals (text config of the architecture).
        self.vocab_size = int(read_config(Path(self.model_path)).get("vocab_size", 1 << 31))

    # ------------------------------------------------------------------ state

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def sleeping(self) -> bool:
        return self._sleeping

    def sleep(self) -> None:
        if self._sleeping:
            return
        self.llm.sleep(level=self.sleep_level)
        self._sleeping, self._weights_awake = True, False

    def wake(self) -> None:
        if not self._sleeping:
            return
        # After a sync while asleep only the KV cache is still asleep.
        self.llm.wake_up(tags=["kv_cache"] if self._weights_awake else None)
        self._sleeping, self._weights_awake = False, True

    def health(self) -> dict[str, Any]:
        return {
            **super().health(),
            "backend": "vllm",
            "vllm_version": getattr(self._vllm, "__version__", "?"),
            "num_requests": self.stats.num_requests,
            "num_generated_tokens": self.stats.num_generated_tokens,
        }

    # ------------------------------------------------------------------ weights

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> dict[str, int]:
        tensors = [(name, tensor.detach().cpu()) for name, tensor in named_tensors]
        if self._sleeping and not self._weights_awake:
            self.llm.wake_up(tags=["weights"])
            self._weights_awake = True
        # collective_rpc serialises the host tensors to every TP worker (msgpack, raw bytes).
        self.llm.collective_rpc("megatron_rl_load_weights", args=(tensors,))
        self._version = int(version)
        self._prefix_cache_stale = True
        return {"num_tensors": len(tensors), "num_bytes": sum(t.numel() * t.element_size() for _, t in tensors)}

    # ------------------------------------------------------------------ generation

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        prompt_seeds: Sequence[int] | None = None,
    ) -> list[list[Completion]]:
        if self._sleeping:
            raise EngineAsleepError(f"{self.name}: generate() called while asleep; call wake() first")
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

        vparams = [
            self._vllm.SamplingParams(
                n=params.n,
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
            [TokensPrompt(prompt_token_ids=list(map(int, p))) for p in prompts], sampling_params=vparams, use_tqdm=False
        )
        results = [self._completions(out) for out in outputs]
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
            group.append(
                Completion(
                    token_ids=token_ids,
                    logprobs=logprobs,
                    finish_reason=out.finish_reason,
                    weight_version=self._version,
                    engine=self.name,
                )
            )
        return group

    def shutdown(self) -> None:
        del self.llm
        torch.cuda.empty_cache()
