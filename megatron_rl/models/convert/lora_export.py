"""A LoRA checkpoint's adapters on the way to HF: merged into the base weights, or as a PEFT adapter.

A LoRA actor's checkpoint (``actor.lora``; :mod:`megatron_rl.models.lora`) stores, beside each
adapted weight ``...linear_qkv.weight``, its adapter ``...linear_qkv.lora_a`` ``[r, in]`` and
``...linear_qkv.lora_b`` ``[out, r]``, full tensors stacked by layer like the weight (B's rows in
the weight's row order: fc1's ``[gate; up]``, the fused QKV's per-group interleaving), so the
update of the fused Megatron weight is ``(alpha / r) B A``.

* merged (:func:`merge_adapter`): ``W + (alpha / r) B A`` in float32, cast back to W's dtype,
  then split into HF tensors like any weight;
* PEFT (:func:`peft_tensors`, :func:`write_peft_adapter`): HF's per-projection modules
  (``q_proj``, ``k_proj``, ``v_proj``; ``gate_proj``, ``up_proj``) each take the fused
  linear's A whole and their rows of B (split exactly as the weight's rows are), which is
  the same update, ``(alpha / r) B_q A`` for ``q_proj``; PEFT's default scaling is
  ``lora_alpha / r`` too. The files are ``adapter_config.json`` and
  ``adapter_model.safetensors`` with PEFT's names
  (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``), loadable with
  ``peft.PeftModel.from_pretrained(base_model, directory)``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import torch

from megatron_rl.models.weight_units import ConversionError, WeightUnit, mcore_to_hf

__all__ = ["ADAPTER_SUFFIXES", "LoRAExport", "adapter_keys", "adapted_units", "merge_adapter", "peft_tensors",
           "write_peft_adapter"]  # fmt: skip

ADAPTER_SUFFIXES = (".lora_a", ".lora_b")
"""How an adapter's parameter names and checkpoint keys end (``...linear_qkv.lora_a``): not a
base-model weight. Here, free of megatron, so the converter needs no megatron import;
:mod:`megatron_rl.models.lora` names its parameters by it."""

PEFT_PREFIX = "base_model.model."
"""What PEFT puts before a causal LM's own parameter names."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoRAExport:
    """The adapters a checkpoint holds (what the actor recorded in ``actor_state.json``)."""

    rank: int
    """r: the adapters' inner width."""
    alpha: float
    """The update is scaled by ``alpha / rank``."""
    target_modules: tuple[str, ...]
    """megatron's names of the adapted linears (``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``)."""
    base_dir: Path | None = None
    """An adapter-only checkpoint's base weights (a HF directory or a Megatron checkpoint);
    None: the checkpoint holds them."""

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def adapted_units(units: Sequence[WeightUnit], lora: LoRAExport) -> list[WeightUnit]:
    """The weight units (layer weights, no biases) of the linears ``lora`` adapts, in ``units``' order."""
    suffixes = tuple(f".{name}.weight" for name in lora.target_modules)
    return [u for u in units if u.layer is not None and u.expert is None and u.sharded_key.endswith(suffixes)]


def adapter_keys(unit: WeightUnit) -> tuple[str, str]:
    """The checkpoint keys of ``unit``'s adapter: ``(...lora_a, ...lora_b)``."""
    stem = unit.sharded_key.removesuffix(".weight")
    return tuple(stem + suffix for suffix in ADAPTER_SUFFIXES)


def _check_adapter(unit: WeightUnit, a: torch.Tensor, b: torch.Tensor, rank: int) -> None:
    out_rows, in_cols = unit.mcore_shape
    a_key, b_key = adapter_keys(unit)
    for key, tensor, want in ((a_key, a, (rank, in_cols)), (b_key, b, (out_rows, rank))):
        if tuple(tensor.shape) != want:
            raise ConversionError(f"adapter tensor '{key}' (layer {unit.layer}) has shape {list(tensor.shape)}, "
                                  f"expected {list(want)} for rank {rank}")  # fmt: skip


def merge_adapter(unit: WeightUnit, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, lora: LoRAExport) -> torch.Tensor:
    """``W + (alpha / r) B A`` of one full Megatron weight (float32 sums, W's dtype)."""
    _check_adapter(unit, a, b, lora.rank)
    return (weight.float() + lora.scale * (b.float() @ a.float())).to(weight.dtype)


def peft_tensors(unit: WeightUnit, a: torch.Tensor, b: torch.Tensor, lora: LoRAExport) -> list[tuple[str, torch.Tensor]]:
    """PEFT's ``lora_A`` / ``lora_B`` tensors of each HF projection ``unit`` makes (A whole, B's rows
    split as the weight's are)."""
    _check_adapter(unit, a, b, lora.rank)
    rows_of_b = dataclasses.replace(unit, mcore_shape=(unit.mcore_shape[0], lora.rank),
                                    hf_shapes=tuple((shape[0], lora.rank) for shape in unit.hf_shapes))  # fmt: skip
    out = []
    for hf_name, b_rows in mcore_to_hf(rows_of_b, b):
        module = PEFT_PREFIX + hf_name.removesuffix(".weight")
        # each projection its own copy of A (safetensors stores no shared tensors)
        out += [(f"{module}.lora_A.weight", a.clone()), (f"{module}.lora_B.weight", b_rows.contiguous())]
    return out


def write_peft_adapter(directory: Path, tensors: dict[str, torch.Tensor], lora: LoRAExport, hf_config: dict) -> None:
    """``adapter_model.safetensors`` and ``adapter_config.json`` (PEFT's LoRA config) into ``directory``."""
    from safetensors.torch import save_file

    modules = sorted({name.rsplit(".", 2)[0].rsplit(".", 1)[-1] for name in tensors})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": hf_config.get("_name_or_path") or None,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": 0.0,
        "target_modules": modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }
    save_file(tensors, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
