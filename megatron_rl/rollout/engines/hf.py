"""A `transformers` rollout engine: batched sampling with a KV cache (CPU default, GPU too).

Why a manual loop instead of ``model.generate``: ``generate`` cannot return the
full-vocabulary log-prob at the temperature *before* top-k/top-p truncation (its
``output_scores`` are the processed scores), cannot draw each sample from its own
random stream, and adds per-step overhead (logits processors, stopping criteria, cache
bookkeeping) that dominates with a tiny model on CPU. The loop here is:

1. **Prefill** the ``B`` distinct prompts once, left-padded to the longest, with an
   attention mask and explicit position ids (``cumsum(mask) - 1``) so padding changes
   neither positions nor attention; only the last position's logits are computed
   (``logits_to_keep=1``).
2. **Fan out** the ``n`` samples of each prompt by repeating the KV cache
   (``DynamicCache.batch_repeat_interleave``): the prompt is encoded once, not ``n`` times.
3. **Decode** one token per step for all live rows; a row that emits a stop token
   leaves the batch (``DynamicCache.batch_select_indices``), so finished samples cost
   nothing. Each row samples with its own pre-drawn uniforms (``sampling.py``), so a
   sample's tokens depend on its prompt seed and sample index, not on its batch
   neighbours (up to floating-point differences of batched matmuls).

Routed experts (``return_routed_experts``, ``rollout.routing_replay``): forward hooks on
the MoE routers record the experts each chose in every forward, the prefill's (left
padding dropped) and each decode step's (the live rows' token of that step), so a
completion carries the routes of its prompt and of every generated token but the last,
which is never fed to the model.

Sleep/wake: on a CUDA device ``sleep`` moves the weights to host memory and empties the
CUDA cache (the KV cache lives only inside ``generate``); ``wake`` moves them back. On
CPU there is no accelerator memory to release, so ``sleep``/``wake`` only switch the
state (``generate`` while asleep still raises, as on every engine).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from megatron_rl.config.seeding import prompt_seeds_for
from megatron_rl.rollout.engines.base import RolloutEngine
from megatron_rl.rollout.engines.sampling import row_seeds, sample_next, sample_uniforms
from megatron_rl.rollout.generation import Completion, GenerateStats, SamplingParams, check_prompts
from megatron_rl.weight_sync.meta import TensorMeta
from megatron_rl.weight_sync.receiver import checkpoint_tensors, has_weights

__all__ = ["HFEngine", "HFEngineArgs"]

logger = logging.getLogger(__name__)

def per_expert_views(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``{checkpoint name: view}`` of the experts of a transformers model that keeps each
    MoE layer's experts fused (transformers 5: ``mlp.experts.gate_up_proj`` ``[E, 2F, H]``,
    gate rows first, and ``mlp.experts.down_proj`` ``[E, H, F]``), under the per-expert
    names its checkpoints and a weight sync use (``mlp.experts.<j>.gate_proj.weight``
    ``[F, H]``, ``up_proj``, ``down_proj``). The views share the live parameters' storage,
    so ``copy_`` into one updates the model. Empty for a model without fused experts."""
    views: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        gate_up = getattr(module, "gate_up_proj", None)
        down = getattr(module, "down_proj", None)
        if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == 3):
            continue
        width = gate_up.shape[1] // 2
        for j in range(gate_up.shape[0]):
            views[f"{prefix}.{j}.gate_proj.weight"] = gate_up[j, :width]
            views[f"{prefix}.{j}.up_proj.weight"] = gate_up[j, width:]
            views[f"{prefix}.{j}.down_proj.weight"] = down[j]
    return views


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The top-k routers of a transformers 5 mixture-of-experts model, in layer order:
    modules with ``top_k``, ``num_experts`` and an ``[E, H]`` ``weight`` (Qwen3-MoE's
    ``Qwen3MoeTopKRouter``), whose forward returns ``(logits, weights, indices)``."""
    return [
        m
        for m in model.modules()
        if hasattr(m, "top_k") and hasattr(m, "num_experts") and getattr(m, "weight", None) is not None
        and m.weight.dim() == 2 and m.weight.shape[0] == m.num_experts
    ]  # fmt: skip


class _RouteRecorder:
    """Collects the expert indices every router returns during one model forward."""

    def __init__(self, routers: list[torch.nn.Module]):
        self.routers = routers
        self._calls: list[torch.Tensor] = []
        self._handles: list = []

    def __enter__(self) -> _RouteRecorder:
        self._handles = [r.register_forward_hook(self._hook) for r in self.routers]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._calls.clear()

    def _hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._calls.append(output[2])

    def take(self) -> torch.Tensor:
        """``[T, M, k]`` int16 on the CPU: the last forward's ``T`` tokens (batch-major, as
        the routers flatten them) through its ``M`` routers."""
        if len(self._calls) != len(self.routers):
            raise RuntimeError(f"{len(self._calls)} router calls in one forward of {len(self.routers)} MoE layers")
        routes = torch.stack(self._calls, dim=1).to("cpu", torch.int16)
        self._calls.clear()
        return routes


@dataclass(kw_only=True)
class HFEngineArgs:
    """Settings of :class:`HFEngine` (``rollout.engine_args`` when ``rollout.engine: hf``)."""

    device: str = "cpu"
    """Torch device of the model (``cpu``, ``cuda``, ``cuda:1``)."""

    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter and compute dtype; log-probs are always computed in float32 from the logits."""

    num_threads: int | None = None
    """``torch.set_num_threads`` for this process (CPU); null leaves torch's default."""

    attn_implementation: str = "sdpa"
    """``transformers`` attention backend (``sdpa``, ``eager``, ``flash_attention_2``)."""

    max_batch_rows: int = 256
    """Most sample rows (prompts x n) decoded together; larger requests run in chunks."""

    return_routed_experts: bool = False
    """Record the experts each MoE layer's router chose for every token the model ran, in
    each completion's ``routed_experts`` (set by the pool for ``rollout.routing_replay``);
    a model without MoE layers refuses it."""

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"engine_args.dtype: got {self.dtype!r}; allowed: {sorted(_DTYPES)}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"engine_args.num_threads: got {self.num_threads}; must be >= 1")
        if self.max_batch_rows < 1:
            raise ValueError(f"engine_args.max_batch_rows: got {self.max_batch_rows}; must be >= 1")


class HFEngine(RolloutEngine):
    """Rollout engine over a ``transformers`` causal LM loaded from a local directory.

    Receives weights as host tensors (``object_store``) or as a member of a ``gloo``
    transfer group (``weight_sync.transports.gloo``), copying each tensor into the model.

    Args:
        model_path: HF model directory (``config.json`` + safetensors; with a config alone
            the engine waits for its first weight update).
        name: engine name used in completions and errors.
        **engine_args: fields of :class:`HFEngineArgs`.
    """

    def __init__(self, model_path: str | Path, *, name: str = "hf", **engine_args: Any):
        from transformers import AutoModelForCausalLM

        try:
            self.args = HFEngineArgs(**engine_args)
        except TypeError as exc:  # unknown key: name the accepted ones
            raise ValueError(f"{exc}; HFEngine accepts {sorted(HFEngineArgs.__dataclass_fields__)}") from None
        if self.args.num_threads is not None:
            torch.set_num_threads(self.args.num_threads)
        self.name = name
        self.model_path = str(model_path)
        self.device = torch.device(self.args.device)
        start = time.perf_counter()
        if has_weights(self.model_path):
            model = AutoModelForCausalLM.from_pretrained(
                self.model_path, dtype=_DTYPES[self.args.dtype], attn_implementation=self.args.attn_implementation
            )
        else:  # a config alone: the architecture, its weights to come with the first update
            from transformers import AutoConfig

            model = AutoModelForCausalLM.from_config(
                AutoConfig.from_pretrained(self.model_path), dtype=_DTYPES[self.args.dtype],
                attn_implementation=self.args.attn_implementation,
            )  # fmt: skip
            self._await_weights()
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.config = self.model.config
        self.vocab_size = int(self.config.vocab_size)
        self.max_positions = int(getattr(self.config, "max_position_embeddings", 1 << 30))
        # state_dict(keep_vars=True) maps every HF name to the live tensor, tied names
        # included (lm_head.weight and model.embed_tokens.weight are the same Parameter).
        self._targets: dict[str, torch.Tensor] = dict(self.model.state_dict(keep_vars=True))
        self._targets.update(per_expert_views(self.model))
        # What a sync carries: the checkpoint's tensors that are tensors of the model.
        self._expected = {
            name: meta
            for name, meta in checkpoint_tensors(self.model_path, _DTYPES[self.args.dtype]).items()
            if name in self._targets
        }
        self._routers = moe_routers(self.model) if self.args.return_routed_experts else []
        if self.args.return_routed_experts and not self._routers:
            raise ValueError("engine_args.return_routed_experts: the model has no mixture-of-experts layers")
        self._receiver = None
        self._sleeping = False
        self.stats = GenerateStats()
        logger.info("%s: loaded %s in %.2fs on %s", name, self.model_path, time.perf_counter() - start, self.device)

    # ------------------------------------------------------------------ state

    routed_experts = True
    weight_backends = ("object_store", "gloo")
    weight_formats = ("auto", "fp8")  # fp8: dequantized on load (weight_sync.fp8)

    @property
    def sleeping(self) -> bool:
        return self._sleeping

    def sleep(self) -> None:
        if self._sleeping:
            return
        if self.device.type == "cuda":
            self.model.to("cpu")
            torch.cuda.empty_cache()
        self._sleeping = True

    def wake(self) -> None:
        if not self._sleeping:
            return
        if self.device.type == "cuda":
            self.model.to(self.device)
        self._sleeping = False

    def health(self) -> dict[str, Any]:
        return {
            **super().health(),
            "backend": "hf",
            "device": str(self.device),
            "num_requests": self.stats.num_requests,
            "num_generated_tokens": self.stats.num_generated_tokens,
        }

    # ------------------------------------------------------------------ weights

    def expected_weights(self) -> dict[str, TensorMeta]:
        return self._expected

    def weight_checksums(self) -> dict[str, str]:
        """SHA-256 of every expected tensor's bytes, by HF name: equal iff bit-identical."""
        import hashlib

        return {
            name: hashlib.sha256(self._targets[name].detach().cpu().contiguous().view(torch.uint8).numpy()).hexdigest()
            for name in self._expected
        }

    @torch.no_grad()
    def _load_host(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        # copy_ converts dtype and device; when asleep on CUDA the target is the host copy
        # and moves back with wake().
        for name, tensor in named_tensors:
            self._targets[name].copy_(tensor)

    def _join_transfer(self, init_info: dict[str, Any]) -> None:
        from megatron_rl.weight_sync.transports.gloo import GlooInitInfo, GlooReceiver

        if self._receiver is not None:
            self._receiver.shutdown()
        self._receiver = GlooReceiver(GlooInitInfo(**init_info))

    def _receive(self, update_info: dict[str, Any]) -> None:
        if self._receiver is None:
            raise RuntimeError(f"{self.name}: receive_weights() before init_weight_transfer()")
        self._receiver.receive(update_info, load=self._load_wire)

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
        for i, prompt in enumerate(prompts):
            if len(prompt) + params.max_new_tokens > self.max_positions:
                raise ValueError(
                    f"{self.name}: prompt {i} has {len(prompt)} tokens; with max_new_tokens={params.max_new_tokens} "
                    f"it exceeds the model's max_position_embeddings ({self.max_positions})"
                )
        seeds = list(prompt_seeds) if prompt_seeds is not None else prompt_seeds_for(params.seed, range(len(prompts)))
        if len(seeds) != len(prompts):
            raise ValueError(f"{self.name}: {len(seeds)} prompt_seeds for {len(prompts)} prompts")
        per_chunk = max(1, self.args.max_batch_rows // params.n)
        results: list[list[Completion]] = []
        for lo in range(0, len(prompts), per_chunk):
            chunk = [list(map(int, p)) for p in prompts[lo : lo + per_chunk]]
            results.extend(self._generate_chunk(chunk, seeds[lo : lo + per_chunk], params))
        self.stats.add(results)
        return results

    def _generate_chunk(
        self, prompts: list[list[int]], seeds: list[int], params: SamplingParams
    ) -> list[list[Completion]]:
        """Generate for ``B`` prompts at once (``R = B * n`` sample rows), recording the
        routers' choices when asked to."""
        if not self._routers:
            return self._sample_chunk(prompts, seeds, params, None)
        with _RouteRecorder(self._routers) as recorder:
            return self._sample_chunk(prompts, seeds, params, recorder)

    @torch.inference_mode()
    def _sample_chunk(
        self, prompts: list[list[int]], seeds: list[int], params: SamplingParams, recorder: _RouteRecorder | None
    ) -> list[list[Completion]]:
        from transformers import DynamicCache

        n, max_new = params.n, params.max_new_tokens
        device = self.device
        num_prompts = len(prompts)
        num_rows = num_prompts * n
        longest = max(len(p) for p in prompts)

        # Left padding keeps every row's last prompt token in the last column, so one
        # decode step appends one column for all rows. Pad id 0 is never attended to.
        input_ids = torch.zeros(num_prompts, longest, dtype=torch.long)
        mask = torch.zeros(num_prompts, longest, dtype=torch.long)
        for i, prompt in enumerate(prompts):
            input_ids[i, longest - len(prompt) :] = torch.tensor(prompt)
            mask[i, longest - len(prompt) :] = 1
        input_ids, mask = input_ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp_(min=0)

        cache = DynamicCache(config=self.config)
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        if recorder is not None:  # [B, longest, M, k], each prompt's tokens at the right
            prompt_routes = recorder.take()
            prompt_routes = prompt_routes.reshape(num_prompts, longest, *prompt_routes.shape[1:])
            generated_routes = torch.full((num_rows, max_new, *prompt_routes.shape[2:]), -1, dtype=torch.int16)

        logits = out.logits[:, -1].float().repeat_interleave(n, dim=0)
        cache.batch_repeat_interleave(n)
        mask = mask.repeat_interleave(n, dim=0)
        next_pos = positions[:, -1:].repeat_interleave(n, dim=0) + 1

        uniforms = sample_uniforms(row_seeds(seeds, n), max_new).to(device)
        stop_ids = torch.tensor(params.stop_token_ids, dtype=torch.long, device=device)
        tokens_RT = torch.zeros(num_rows, max_new, dtype=torch.long, device=device)
        logp_RT = torch.zeros(num_rows, max_new, dtype=torch.float32, device=device)
        lengths = torch.full((num_rows,), max_new, dtype=torch.long, device=device)
        stopped = torch.zeros(num_rows, dtype=torch.bool, device=device)
        live = torch.arange(num_rows, device=device)  # original row of each batch row

        for step in range(max_new):
            tok, lp = sample_next(logits, uniforms[live, step], params)
            tokens_RT[live, step] = tok
            logp_RT[live, step] = lp
            if stop_ids.numel():
                hit = torch.isin(tok, stop_ids)
                if bool(hit.any()):
                    lengths[live[hit]] = step + 1
                    stopped[live[hit]] = True
                    keep = (~hit).nonzero().squeeze(-1)
                    if keep.numel() == 0:
                        break
                    # Drop finished rows from every batched tensor, the KV cache included.
                    cache.batch_select_indices(keep)
                    live, tok, mask, next_pos = live[keep], tok[keep], mask[keep], next_pos[keep]
            if step == max_new - 1:
                break
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            out = self.model(
                input_ids=tok[:, None],
                attention_mask=mask,
                position_ids=next_pos,
                past_key_values=cache,
                use_cache=True,
            )
            next_pos = next_pos + 1
            logits = out.logits[:, -1].float()
            if recorder is not None:  # the routes of generated token `step`, fed just now
                generated_routes[live.cpu(), step] = recorder.take()

        tokens_list = tokens_RT.cpu().tolist()
        logp_list = logp_RT.cpu().tolist()
        length_list = lengths.cpu().tolist()
        stopped_list = stopped.cpu().tolist()
        results: list[list[Completion]] = []
        for i in range(num_prompts):
            group = []
            for r in range(i * n, (i + 1) * n):
                length = length_list[r]
                routes = None
                if recorder is not None:  # the prompt's tokens, then every generated one but the last
                    routes = torch.cat([prompt_routes[i, longest - len(prompts[i]) :], generated_routes[r, : length - 1]])
                group.append(
                    Completion(
                        token_ids=tokens_list[r][:length],
                        logprobs=logp_list[r][:length],
                        finish_reason="stop" if stopped_list[r] else "length",
                        weight_version=self._version,
                        engine=self.name,
                        routed_experts=routes,
                    )
                )
            results.append(group)
        return results
