"""The router auxiliary losses of a mixture-of-experts actor: what they add to the loss, as metrics.

megatron-core's routers add their auxiliary losses (load balancing ``aux_loss``, and
``z_loss`` where a run sets ``moe_z_loss_coeff``) to the gradient themselves, inside the
router's forward (``MoEAuxLossAutoScaler``), and record each one, divided by its
coefficient, in a process-wide tracker (``values[layer]``, summed over forwards). Under
``calculate_per_token_loss`` (the actor's loss contract, ``actor/actor.py``) a router
that routed ``t`` tokens in a micro-batch adds ``coeff * loss * t`` to the summed loss,
and the gradient is divided by the step's global count like the policy loss. So the
objective the optimizer follows is

    loss/total = (sum(policy loss) + sum over micro-batches, layers of coeff * loss * t) / count

:class:`RouterLossMeter` reads the tracker around each router call of the training
forwards that adds the losses (forward hooks), and reports, reduced over the pipeline
stages and data-parallel replicas. Which call adds them: a router adds its losses only
when it runs with grad. Without activation recompute that is the schedule's forward
step. With a full recompute, megatron runs a checkpointed layer's forward without grad
(no losses) and again in the backward pass with grad: the recomputed call adds them, so
that is the one counted (each forward step's calls are queued per router and the
recompute takes them in order: the backward passes of a layer run in its forwards' order).

* ``moe/<name>``: the mean over the MoE layers and micro-batches of each loss as megatron
  logs it (``load_balancing_loss``: ``E * sum_i f_i P_i`` of one layer and micro-batch,
  f the fraction of the k routed slots that went to expert i, P the mean router probability);
* ``loss/moe_aux``: ``sum coeff * loss * t / count``, the term above. With sequence
  parallelism each TP rank routes a 1/TP slice of the tokens (``t`` is its slice's count)
  and its tracked loss is that slice's share of the layer's loss (megatron computes the
  expert loads over the TP group, the probabilities over the slice); the router's
  gradients are summed over the TP group, so both reports sum the TP ranks' terms.

A filler micro-batch (``actor.batch.filler_microbatch``) runs with the coefficients at 0,
its recomputed layers too, so it adds nothing to the gradient, the tracker or the metrics.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl.actor.collectives import device
from megatron_rl.actor.launch import ProcessGroups
from megatron_rl.models.moe import megatron_routers

__all__ = ["RouterLossMeter"]

_AUX_TYPES = {
    "load_balancing_loss": "aux_loss",
    "seq_load_balancing_loss": "seq_aux_loss",
    "global_load_balancing_loss": "global_aux_loss",
}
"""megatron's tracker names of the load-balancing losses -> their ``moe_router_load_balancing_type``."""
_COEFFICIENT_FIELDS = ("moe_aux_loss_coeff", "moe_z_loss_coeff")


class RouterLossMeter:
    """Router auxiliary losses of one ``train_step`` (see the module doc).

    Built once per model chunk list; :meth:`recording` wraps each forward of the
    training schedule; :meth:`metrics` after the schedule. One per actor.
    """

    def __init__(self, chunks: list[torch.nn.Module], config: Any, groups: ProcessGroups):
        self.config = config
        self.groups = groups
        self.routers = megatron_routers(chunks)
        """This rank's routers (one per MoE layer of its pipeline stage)."""
        self._forward: str | None = None
        """Inside a training forward step: ``"real"`` or ``"filler"``; else ``None``."""
        self._queued: dict[int, list[str]] = {}
        """Per router: the forward steps whose losses its recompute adds (oldest first)."""
        self._before: dict[int, dict[str, float]] = {}
        self._zeroed: dict[int, dict[str, Any]] = {}
        self.reset()
        for router in self.routers:
            router.register_forward_pre_hook(self._pre_hook)
            router.register_forward_hook(self._hook)

    def reset(self) -> None:
        """Forget the previous step's values, and megatron's tracker's entries: it is
        process-wide and sized by the first model that wrote to it, so another model in
        the same process (more layers) would index past it."""
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        get_moe_layer_wise_logging_tracker().clear()
        self._queued = {}
        self.sums: dict[str, torch.Tensor] = {}
        """``{tracker name: sum of the losses of the counted router calls}`` (0-dim)."""
        self.weighted: dict[str, torch.Tensor] = {}
        """``{tracker name: sum of loss * replica tokens over the counted calls}`` (0-dim)."""
        self.calls = 0
        """Router calls counted (layers x micro-batches on this rank)."""

    @contextlib.contextmanager
    def recording(self, *, filler: bool) -> Iterator[None]:
        """Count the router calls of one training forward; a filler runs without the losses."""
        self._forward = "filler" if filler else "real"
        saved = self._zero_coefficients() if filler else {}
        try:
            yield
        finally:
            self._forward = None
            self._restore_coefficients(saved)

    def _zero_coefficients(self) -> dict[str, Any]:
        saved = {field: getattr(self.config, field) for field in _COEFFICIENT_FIELDS}
        for field, value in saved.items():
            if value is not None:
                setattr(self.config, field, [0.0] * len(value) if isinstance(value, (list, tuple)) else 0.0)
        return saved

    def _restore_coefficients(self, saved: dict[str, Any]) -> None:
        for field, value in saved.items():
            setattr(self.config, field, value)

    @staticmethod
    def _tracked(layer: int) -> dict[str, torch.Tensor]:
        """This layer's tracker values (copies; no host read)."""
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        tracker = get_moe_layer_wise_logging_tracker()
        return {name: entry["values"][layer - 1].clone() for name, entry in tracker.items() if layer <= len(entry["values"])}

    def _pre_hook(self, router: torch.nn.Module, args: Any) -> None:
        if not router.training:
            return
        kind = self._forward
        if kind is not None and not torch.is_grad_enabled():  # a checkpointed layer's first pass
            self._queued.setdefault(id(router), []).append(kind)
            return
        if kind is None:  # outside the forward step: a recompute in the backward pass, or nothing of ours
            queue = self._queued.get(id(router))
            if not (queue and torch.is_grad_enabled()):
                return
            kind = queue.pop(0)
            if kind == "filler":
                self._zeroed[id(router)] = self._zero_coefficients()
        if kind == "real":
            self._before[id(router)] = self._tracked(router.layer_number)

    def _hook(self, router: torch.nn.Module, args: Any, output: Any) -> None:
        self._restore_coefficients(self._zeroed.pop(id(router), {}))
        before = self._before.pop(id(router), None)
        if before is None:
            return
        tokens = output[1].shape[0]  # the routing map's rows: the tokens this rank routed
        self.calls += 1
        for name, value in self._tracked(router.layer_number).items():
            delta = (value - before[name]) if name in before else value
            self.sums[name] = self.sums.get(name, 0.0) + delta
            self.weighted[name] = self.weighted.get(name, 0.0) + delta * tokens

    def _coefficient(self, name: str) -> float:
        if name == "z_loss":
            return float(self.config.moe_z_loss_coeff or 0.0)
        kind = _AUX_TYPES.get(name)
        if kind is None or not self.routers:
            return 0.0
        return float(self.routers[0].get_aux_loss_coeff(kind))

    def metrics(self, count: float) -> dict[str, float]:
        """``moe/<name>`` and ``loss/moe_aux`` (module doc) for a step whose global loss
        count is ``count``; the same on every rank. Collective over the world (a sum over
        the PP and DP groups; TP ranks hold identical values)."""
        names = sorted({*_AUX_TYPES, "z_loss"})
        zero = torch.zeros((), dtype=torch.float64)
        local = [torch.as_tensor(self.sums.get(n, zero), dtype=torch.float64).cpu() for n in names]
        local += [torch.as_tensor(self.weighted.get(n, zero), dtype=torch.float64).cpu() for n in names]
        total = torch.stack([*local, torch.tensor(float(self.calls), dtype=torch.float64)]).to(device())
        if self.config.sequence_parallel and self.groups.tp_size > 1:
            # Each TP rank routes a 1/TP slice: its loss is that slice's share, and the
            # router's gradients are summed over the TP group (the calls are the same ones).
            dist.all_reduce(total[:-1], group=self.groups.tp)
        for group, size in ((self.groups.pp, self.groups.pp_size), (self.groups.dp, self.groups.dp_size)):
            if size > 1:
                dist.all_reduce(total, group=group)
        total = total.cpu()
        calls = float(total[-1])
        out: dict[str, float] = {}
        aux = 0.0
        for i, name in enumerate(names):
            coeff = self._coefficient(name)
            if not coeff:
                continue
            out[f"moe/{name}"] = float(total[i]) / calls if calls else 0.0
            aux += coeff * float(total[len(names) + i]) / count if count > 0 else 0.0
        out["loss/moe_aux"] = aux
        return out

