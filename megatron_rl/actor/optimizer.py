"""The actor's optimizer: the run's ``OptimConfig`` mapped to megatron-core, in one place.

:func:`build_optimizer` turns the optimizer settings (declared once, in
``config.trainer.OptimConfig``) into megatron's ``OptimizerConfig`` + ``get_megatron_optimizer``
(Adam; the DistributedOptimizer when ``actor.use_distributed_optimizer``) and its
``OptimizerParamScheduler``. :func:`optimizer_step` is megatron's ``prepare_grads`` /
``get_grad_norm`` / clip / ``step_with_ready_grads`` sequence with one extra rule: if
the global loss or the gradient norm is not finite, the update is skipped (weights, Adam
moments and step, LR schedule untouched). :func:`set_adam_kernel` picks torch AdamW's
implementation (``actor.optimizer_kernel``) through the options torch keeps per parameter
group, the same way megatron asks for the fused kernel in its CPU-offload optimizer.

Adam's state as checkpoints see it (the end of this file): the step count, torch AdamW's
lazily allocated state, and loading the ``fully_reshardable`` format around a
megatron-core 0.16.1 bug (``load_optimizer_state``), with megatron's own methods only.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from megatron_rl.actor.compat import cpu_shim
from megatron_rl.config.lib import ConfigError
from megatron_rl.config.trainer import OptimConfig

__all__ = [
    "adam_settings",
    "adam_step",
    "build_optimizer",
    "chained",
    "init_adam_state",
    "is_distributed",
    "load_optimizer_state",
    "optimizer_step",
    "set_adam_kernel",
    "set_adam_step",
    "uses_torch_adam",
]


def build_optimizer(
    ddp: Any,
    optim: OptimConfig,
    *,
    params_dtype: torch.dtype,
    use_distributed_optimizer: bool,
    lr_decay_steps: int,
    kernel: str = "auto",
) -> tuple[Any, Any]:
    """``(optimizer, scheduler)`` for the megatron-DDP-wrapped model ``ddp``.

    Args:
        optim: the optimizer settings (``trainer`` section).
        params_dtype: the model's parameter dtype (bf16 keeps float32 master weights).
        use_distributed_optimizer: shard the optimizer state over the DP group.
        lr_decay_steps: optimizer steps of the whole run (cosine/linear decay length).
        kernel: ``actor.optimizer_kernel`` (:func:`set_adam_kernel`).
    """
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    config = OptimizerConfig(
        optimizer="adam",
        lr=optim.lr,
        min_lr=optim.min_lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1,
        adam_beta2=optim.adam_beta2,
        adam_eps=optim.adam_eps,
        clip_grad=optim.grad_clip or 0.0,
        bf16=params_dtype == torch.bfloat16,
        params_dtype=params_dtype,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    if kernel != "auto" and not uses_torch_adam():
        raise ConfigError(
            "actor.optimizer_kernel",
            f"{kernel!r} chooses torch's AdamW implementation, but megatron-core uses Transformer Engine's "
            "or Apex's fused Adam here; use 'auto'",
        )
    with cpu_shim.cuda_to_cpu():
        optimizer = get_megatron_optimizer(config, [ddp])
    set_adam_kernel(optimizer, kernel)
    decay_steps = max(lr_decay_steps, optim.lr_warmup_steps + 1, 1)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if optim.lr_warmup_steps > 0 else optim.lr,
        max_lr=optim.lr,
        min_lr=optim.min_lr,
        lr_warmup_steps=optim.lr_warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style=optim.lr_schedule,
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=decay_steps,
        wd_incr_style="constant",
    )
    return optimizer, scheduler


def chained(optimizer: Any) -> list[Any]:
    """The parts of a megatron optimizer (a ``ChainedOptimizer``'s, or the optimizer itself),
    each wrapping one torch optimizer as ``.optimizer``."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def uses_torch_adam() -> bool:
    """Whether megatron-core builds torch's AdamW (neither Transformer Engine nor Apex present)."""
    import megatron.core.optimizer as mcore_optimizer

    return bool(getattr(mcore_optimizer, "USING_PYTORCH_OPTIMIZER", False))


def set_adam_kernel(optimizer: Any, kernel: str) -> None:
    """Set torch AdamW's implementation in every parameter group of ``optimizer`` (megatron's,
    possibly chained): ``fused`` (also ``auto``), ``foreach`` or ``for_loop``. A no-op when
    megatron uses TE's or Apex's Adam. Call again after ``load_state_dict``, which restores
    the saved groups' options."""
    if not uses_torch_adam():
        return
    options = {
        "auto": (True, False),
        "fused": (True, False),
        "foreach": (False, True),
        "for_loop": (False, False),
    }
    fused, foreach = options[kernel]
    for opt in chained(optimizer):
        inner = getattr(opt, "optimizer", None)  # None on a rank without trainable parameters
        for group in getattr(inner, "param_groups", []):
            group["fused"], group["foreach"] = fused, foreach


def optimizer_step(optimizer: Any, scheduler: Any, *, grad_clip: float | None, loss_finite: bool) -> tuple[float, bool]:
    """One optimizer step with a non-finite guard; returns (grad norm before clipping, updated).

    Collective over megatron's grad-stats group: every rank gets the same norm and decision.
    """
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    with torch.no_grad(), cpu_shim.cuda_to_cpu():
        found_inf = optimizer.prepare_grads()
        grad_norm = float(optimizer.get_grad_norm())
        if found_inf or not loss_finite or not math.isfinite(grad_norm):
            return grad_norm, False
        if grad_clip:
            for opt in chained(optimizer):
                params = opt.get_parameters()
                if params:
                    clip_grad_by_total_norm_fp32(
                        params,
                        max_norm=grad_clip,
                        total_norm=grad_norm,
                        use_decoupled_grad=opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8,
                    )
        optimizer.step_with_ready_grads()
    scheduler.step(increment=1)
    return grad_norm, True


# --------------------------------------------------------------------------- Adam's state in checkpoints


def adam_step(optimizer) -> float | None:
    """The Adam step count of a megatron optimizer (None before the first step)."""
    steps = set()
    for opt in chained(optimizer):
        for state in opt.optimizer.state.values():
            if "step" in state:
                steps.add(float(state["step"]))
    if len(steps) > 1:
        raise RuntimeError(f"inconsistent Adam step counts across parameters: {sorted(steps)}")
    return steps.pop() if steps else None


def set_adam_step(optimizer, step: float) -> None:
    """Set the per-parameter Adam ``step`` of every (allocated) optimizer state."""
    for opt in chained(optimizer):
        for state in opt.optimizer.state.values():
            if "step" in state:
                old = state["step"]
                if torch.is_tensor(old):  # a new tensor per parameter: never shared
                    state["step"] = torch.tensor(float(step), dtype=old.dtype, device=old.device)
                else:
                    state["step"] = float(step)


def init_adam_state(optimizer) -> None:
    """Allocate torch Adam's per-parameter state (zeros, ``step`` 0) where it is still empty.

    Without TE/Apex (CPU) megatron uses ``torch.optim.AdamW``, whose state appears only
    at the first step; the DistributedOptimizer's ``state_dict()`` asserts on a ``step``
    entry, so a fresh optimizer cannot even describe what it wants to load. This is
    exactly the state torch's Adam creates lazily, so it changes nothing else.
    """
    for opt in chained(optimizer):
        inner = opt.optimizer
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                state = inner.state[p]
                if len(state) == 0:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def is_distributed(optimizer) -> bool:
    """Whether ``optimizer`` (megatron's, possibly chained) shards its state over DP."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return any(isinstance(opt, DistributedOptimizer) for opt in chained(optimizer))


def adam_settings(optimizer) -> dict[str, Any]:
    """Adam's betas and eps as the optimizer holds them (loading a checkpoint restores its
    param groups, so a resume compares these with the config's)."""
    groups = getattr(optimizer, "param_groups", None) or []
    group = groups[0] if groups else {}
    if "betas" not in group:
        return {}
    return {"adam": {"beta1": float(group["betas"][0]), "beta2": float(group["betas"][1]), "eps": float(group["eps"])}}


def load_optimizer_state(optimizer, state: dict) -> None:
    """``optimizer.load_state_dict(state)``, working around a megatron-core 0.16.1 bug.

    With torch's AdamW (no TE/Apex), ``load_parameter_state_from_fully_reshardable``
    copies every key of the per-parameter state, ``step`` included, from tensors that
    never contain ``step`` (``KeyError: 'step'``). For that format the two halves of
    ``DistributedOptimizer.load_state_dict`` are called here in turn, with ``step`` held
    out of the state during the second; the step is restored by the caller. A
    ``ChainedOptimizer`` (expert parameters apart, at expert parallelism > 1) gets its
    parts' states in its own order (``chained_<i>``). Megatron's own methods only,
    nothing patched.
    """
    parts = chained(optimizer)
    if len(parts) == 1:
        states = [state]
    else:
        states = [v for _, v in sorted(state.items())] if isinstance(state, dict) else list(state)
        if len(states) != len(parts):
            raise RuntimeError(f"the optimizer has {len(parts)} parts, its saved state {len(states)}")
    for opt, part in zip(parts, states):
        _load_part_state(opt, part)


def _load_part_state(opt, state: dict) -> None:
    """One megatron optimizer's ``load_state_dict`` (see :func:`load_optimizer_state`)."""
    if not isinstance(state, dict) or state.get("param_state_sharding_type") != "fully_reshardable":
        opt.load_state_dict(state)
        return
    rest = {k: v for k, v in state.items() if k not in ("param_state", "param_state_sharding_type")}
    opt.load_state_dict(rest)  # torch optimizer skeleton, param groups, grad scaler
    held = {}
    for key, entry in opt.optimizer.state.items():
        if "step" in entry:
            held[key] = entry.pop("step")
    opt.load_parameter_state_from_fully_reshardable(state["param_state"])
    for key, step in held.items():
        opt.optimizer.state[key]["step"] = step
