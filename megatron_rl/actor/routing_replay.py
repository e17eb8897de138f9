"""Routing replay for a mixture-of-experts policy: its routers take the experts the rollout
engine chose for each token instead of choosing anew.

Why: a MoE policy's log-probs depend on which experts each token reaches, and the router
that picked them in generation (the engine's weights, its kernels, its batch) and the
actor's router on the same weights disagree on some tokens; each disagreement is a
different sub-network, the largest source of the train/inference log-prob mismatch of
MoE models. Replaying the engine's choices in the actor's log-prob and training forwards
removes it (R3, "rollout routing replay"); the gating weights are still the actor's own
(its router's scores at the replayed experts), so the router keeps its gradient.

What a replayed router does (:func:`replay_router_class`, one instance per MoE layer,
given to megatron-core's ``TopKRouter`` as its ``router_replay``; megatron's
``topk_routing_with_score_function`` asks it for the top-k):

* it computes its own top-k as usual, then takes the engine's experts for every token
  that has them. A token without (-1: each sequence's last token, which the engine never
  ran, and padding) keeps its own choice: its output reaches no loss term.
* the probabilities are its scores gathered at the chosen experts (megatron's replay
  formula), so the softmax over the k taken logits follows as usual.
* it counts, for the tokens with engine choices, how many of the k engine choices its
  own top-k also made (``moe/routing_agreement``).

Token order: a router sees its layer's input ``[s, b, H]`` flattened to ``[s * b]``
(position-major), packed micro-batches as ``[S, 1]``, and with sequence parallelism only
its TP rank's ``s / TP`` slice; :meth:`RoutingReplay.replaying` lays a micro-batch's
``[b, s, M, k]`` engine choices out the same way, per layer (``M`` MoE layers; a router
with global layer number ``l`` takes column ``l - 1``: every layer is a MoE layer, the
only layout the adapter builds).

Activation recompute re-runs a router in the backward pass, outside the schedule's
forward step, and megatron runs a checkpointed layer's first pass without grad: such a
pass queues its targets, and a router call outside :meth:`RoutingReplay.replaying` with
grad takes the oldest queued one (the backward passes of a layer run in its forwards'
order), so the recomputed forward routes as the original did. The queues are cleared at
each :meth:`RoutingReplay.begin`.

Nothing here imports megatron-core at module level.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl.actor.batch import NO_ROUTE
from megatron_rl.models.moe import megatron_routers

__all__ = ["RoutingReplay", "replay_router_class"]


@functools.cache
def replay_router_class() -> type:
    """megatron-core's ``RouterReplay`` that mixes replayed and own choices and counts their
    agreement (see the module doc). Built on first use."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    class MixedRouterReplay(RouterReplay):
        """One MoE layer's replay state (one per router; not in megatron's global list, so
        that megatron's static controls never reach another model's routers)."""

        def __init__(self) -> None:
            super().__init__()
            RouterReplay.global_router_replay_instances.remove(self)
            self.target: torch.Tensor | None = None
            """``[T, k]`` int64 engine choices for the current forward (``NO_ROUTE`` rows
            route anew), or ``None`` outside a replayed forward."""
            self.training = False
            """Whether the current replayed forward is one of the training schedule."""
            self.queued: list[torch.Tensor] = []
            """Targets of checkpointed first passes, for their recompute (oldest first)."""
            self.agreed = torch.zeros((), dtype=torch.int64)
            """Engine choices this router's own top-k also made, since the last reset."""
            self.compared = torch.zeros((), dtype=torch.int64)
            """Engine choices compared, since the last reset."""

        def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            """``(probs, indices)`` ``[T, k]``: the engine's experts where given, else this
            router's own top-k; ``probs`` are ``scores`` at those experts."""
            probs, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            target = self.target
            if target is None:
                if not (torch.is_grad_enabled() and self.queued):
                    return probs, own
                target = self.queued.pop(0)  # an activation recompute in the backward pass
            else:
                target = target.to(own.device)
                if target.shape != own.shape:
                    raise ValueError(
                        f"routed_experts: layer {self.layer_number} got {tuple(target.shape)} choices for "
                        f"{tuple(own.shape)} routed tokens x top-k"
                    )
                if self.training and not torch.is_grad_enabled():  # a checkpointed layer's first pass
                    self.queued.append(target)
                self._count(target, own)
            given = target[:, :1] >= 0
            indices = torch.where(given, target, own)
            return scores.gather(1, indices), indices

        def _count(self, target: torch.Tensor, own: torch.Tensor) -> None:
            given = target[:, 0] >= 0
            same = (target[:, :, None] == own[:, None, :]).any(-1) & given[:, None]
            self.agreed = self.agreed.to(own.device) + same.sum()
            self.compared = self.compared.to(own.device) + given.sum() * target.shape[1]

    return MixedRouterReplay


class RoutingReplay:
    """Replays engine routing in one policy's MoE layers (see the module doc).

    Built once per model chunk list: gives each ``TopKRouter`` of this rank a replay
    instance. :meth:`replaying` wraps each micro-batch's forward in the schedule;
    :meth:`agreement` reads the counts.
    """

    def __init__(self, chunks: list[torch.nn.Module], config: Any, *, tp_rank: int, tp_size: int):
        if getattr(config, "moe_router_fusion", False):
            # Transformer Engine's fused top-k routing does not consult a replay.
            raise ValueError("routing replay needs moe_router_fusion=False (the fused router cannot replay)")
        self.num_layers = int(config.num_layers)
        self.topk = int(config.moe_router_topk)
        self.num_experts = int(config.num_moe_experts)
        self.sequence_parallel = bool(config.sequence_parallel) and tp_size > 1
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.routers = megatron_routers(chunks)
        """This rank's routers (one per MoE layer of its pipeline stage)."""
        cls = replay_router_class()
        for router in self.routers:
            router.router_replay = cls()
            router.router_replay.layer_number = router.layer_number

    def begin(self) -> None:
        """Start a pass: drop recompute targets a previous pass left (a forward-only
        pass queues none; a pass without recompute never takes them)."""
        for router in self.routers:
            router.router_replay.queued.clear()

    def check(self, routed: torch.Tensor) -> None:
        """Raise ``ValueError`` naming the field unless ``routed`` (``[N, L, M, k]``, a
        batch's engine choices) fits this model: M MoE layers, top-k, known experts."""
        layers, k = routed.shape[2:]
        if (layers, k) != (self.num_layers, self.topk):
            raise ValueError(
                f"routed_experts has {layers} layers x top-{k}; the model has {self.num_layers} MoE layers x "
                f"top-{self.topk}"
            )
        if routed.numel() and (int(routed.max()) >= self.num_experts or int(routed.min()) < NO_ROUTE):
            raise ValueError(f"routed_experts holds an expert outside [0, {self.num_experts}) other than {NO_ROUTE}")

    @contextlib.contextmanager
    def replaying(self, routed: torch.Tensor | None, *, training: bool) -> Iterator[None]:
        """Route one micro-batch's forward by ``routed``: ``[b, s, M, k]`` engine choices
        aligned with its ``input_ids`` (``[b, s]``, or ``[1, S]`` packed), ``NO_ROUTE``
        where the engine gave none; ``None`` routes every token anew. ``training``: a
        forward of the training schedule (a router call in it without grad is a
        checkpointed layer's first pass, whose recompute will replay the same targets)."""
        if routed is not None:
            layers, k = routed.shape[2:]
            order = routed.transpose(0, 1)  # [s, b, M, k]: the router's position-major order
            if self.sequence_parallel:
                order = order.chunk(self.tp_size, dim=0)[self.tp_rank]
            order = order.reshape(-1, layers, k).long()
            for router in self.routers:
                router.router_replay.target = order[:, router.layer_number - 1]
                router.router_replay.training = training
        try:
            yield
        finally:
            for router in self.routers:
                router.router_replay.target = None
                router.router_replay.training = False

    def agreement(self, group: dist.ProcessGroup | None = None) -> tuple[int, int]:
        """``(agreed, compared)`` engine choices since the last call, summed over this rank's
        layers and, with ``group``, over its ranks; then reset."""
        agreed = sum((r.router_replay.agreed.cpu() for r in self.routers), torch.zeros((), dtype=torch.int64))
        compared = sum((r.router_replay.compared.cpu() for r in self.routers), torch.zeros((), dtype=torch.int64))
        for router in self.routers:
            router.router_replay.agreed = torch.zeros((), dtype=torch.int64)
            router.router_replay.compared = torch.zeros((), dtype=torch.int64)
        counts = torch.stack([agreed, compared])
        if group is not None:
            from megatron_rl.actor.collectives import device

            counts = counts.to(device())
            dist.all_reduce(counts, group=group)
        return int(counts[0]), int(counts[1])
