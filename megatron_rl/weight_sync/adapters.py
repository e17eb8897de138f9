"""A LoRA actor's adapters as a weight update of their own (``rollout.lora_sync: adapter``).

With ``adapter`` sync an engine holds the frozen base weights, sent once through the run's
weight transport like any version (the actor sends ``W``, not ``W + (alpha/r) B A``), and at
every version only the adapters: an :class:`AdapterUpdate`, PEFT-named full tensors
(``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``: the fused Megatron
linears split into HF's projections, ``models.convert.lora_export``) plus rank and alpha.
The engine writes them as a PEFT adapter directory (:meth:`AdapterUpdate.write`) and loads
it through its own LoRA support (vLLM: ``LoRARequest(..., load_inplace=True)``); its weight
version is then the adapters' version. An update is small (``2 r (in + out)`` values per
adapted projection), so it goes through the object store whatever the transport is.

Where the base is re-sent: ``weight_sync.sync.WeightSync`` sends it at its first sync, after
any engine restart and whenever an engine is not at the pool's version; a restarted engine
is restored to base plus the pool's last adapters (``rollout.pool.weights.PoolWeights``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

__all__ = ["VLLM_LORA_RANKS", "AdapterUpdate", "engine_lora_rank"]

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The adapter ranks vLLM 0.32 sizes its LoRA buffers for (``LoRAConfig.max_lora_rank``);
an adapter of rank r loads into the smallest of them that is >= r."""


def engine_lora_rank(rank: int) -> int:
    """The ``max_lora_rank`` a vLLM engine needs for adapters of ``rank`` (``actor.lora.rank``).

    Raises:
        ValueError: ``rank`` is above vLLM's largest (512).
    """
    fitting = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fitting:
        raise ValueError(f"actor.lora.rank {rank}: vLLM loads adapters up to rank {VLLM_LORA_RANKS[-1]}")
    return fitting[0]


@dataclasses.dataclass(kw_only=True)
class AdapterUpdate:
    """One version of the actor's adapters, as the engines load it."""

    rank: int
    """r, the adapters' inner width (``actor.lora.rank``)."""
    alpha: float
    """The update is scaled by ``alpha / rank`` (``actor.lora.alpha``)."""
    tensors: dict[str, torch.Tensor]
    """PEFT's ``lora_A`` ``[r, in]`` / ``lora_B`` ``[out, r]`` tensors by PEFT name, full
    (TP shards joined, every pipeline stage's layers), float32 on the host."""

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def write(self, directory: Path) -> Path:
        """The PEFT adapter directory (``adapter_config.json``, ``adapter_model.safetensors``)
        in ``directory`` (created); returns it. It names no base model: the engine loads it
        over the base it holds."""
        from megatron_rl.models.convert.lora_export import LoRAExport, write_peft_adapter

        directory.mkdir(parents=True, exist_ok=True)
        lora = LoRAExport(rank=self.rank, alpha=self.alpha, target_modules=())
        write_peft_adapter(directory, self.tensors, lora, {})
        return directory
