"""The ``parallel`` section: how the actor is split over its ranks, and where Ray puts work."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_rl.config.lib import ConfigError, check_literals, require_range
from megatron_rl.config.model import require_positive_ints


@dataclass(kw_only=True)
class ParallelConfig:
    """How the actor (trainer) model is split over its ranks (Megatron parallel sizes)."""

    num_actor_ranks: int = 1
    """Processes (GPUs, or CPU ranks) that train the actor."""

    tensor_model_parallel_size: int = 1
    """Tensor-parallel (TP) size: each layer's weights are split over this many ranks."""

    pipeline_model_parallel_size: int = 1
    """Pipeline-parallel (PP) size: the layers are split into this many stages."""

    context_parallel_size: int = 1
    """Context-parallel (CP) size: each sequence is split over this many ranks. Only 1 is
    supported yet (a larger value is a config error)."""

    data_parallel_size: int | None = None
    """Data-parallel (DP) size; null derives it as ``num_actor_ranks / (TP * PP * CP)``."""

    expert_model_parallel_size: int = 1
    """Expert-parallel (EP) size of a mixture-of-experts model: each MoE layer's routed
    experts are split over this many ranks, which send each token to its experts' ranks with
    an all-to-all. Megatron builds the expert groups apart from the dense layers' (its
    ``tp-ep-dp-pp`` order over the same ranks), so EP may be any divisor of
    ``num_actor_ranks / (ETP * PP)``; the model's expert count must be a multiple of it
    (checked before start). Dense models need 1."""

    expert_tensor_parallel_size: int | None = None
    """Tensor-parallel size of each expert's weights (ETP); null: ``tensor_model_parallel_size``
    (megatron's default). Any divisor of the expert width that fits the world
    (``num_actor_ranks`` a multiple of ETP * EP * PP): ETP = 1 with TP > 1 keeps each
    expert whole on one rank, the usual layout for fine-grained experts (Qwen3-30B-A3B's
    768-wide experts), so the expert all-to-all moves no expert-width shards. Only read
    for mixture-of-experts models."""

    sequence_parallel: bool = False
    """Megatron sequence parallelism: activations outside attention and MLP (norms,
    dropout, residuals) are sharded along the sequence over the TP group, cutting their
    memory by TP; needs ``tensor_model_parallel_size > 1``."""

    ray_scheduling: Literal["default", "spread"] = "default"
    """How the actor ranks and the rollout engines are placed on the Ray cluster's nodes:
    ``default`` leaves it to Ray (which tends to fill the driver's node first, so a small
    run may use one node); ``spread`` splits each group into contiguous blocks, one per
    alive node (rank ``i`` of ``k`` on node ``i * n // k``, pinned with Ray's node
    affinity), so every node gets work and neighbouring ranks share a node. The actual
    placement is written to ``RUN_DIR/placement.json`` at startup."""

    cpu_threads: int | None = None
    """Torch threads of each actor rank and each rollout engine. null: on GPUs 1 (the
    device does the work); on a CPU cluster the smallest node's Ray CPUs divided by the
    larger of the actor ranks and the engines, at least 1: the actor and the engines take turns
    (generation, then the update), so each side may use the cores while the other waits.
    With ``rollout.max_staleness`` >= 1 both work at once: divided by their sum."""

    def __post_init__(self) -> None:
        check_literals(self)
        require_range("cpu_threads", self.cpu_threads, ge=1, le=4096)
        require_positive_ints(
            self, "num_actor_ranks", "tensor_model_parallel_size", "pipeline_model_parallel_size",
            "context_parallel_size",
        )  # fmt: skip
        require_range("data_parallel_size", self.data_parallel_size, ge=1)
        require_range("expert_model_parallel_size", self.expert_model_parallel_size, ge=1, le=1 << 16)
        require_range("expert_tensor_parallel_size", self.expert_tensor_parallel_size, ge=1, le=1 << 16)
        for name in ("num_actor_ranks", "tensor_model_parallel_size", "pipeline_model_parallel_size"):
            require_range(name, getattr(self, name), ge=1, le=1 << 16)  # more ranks than any cluster has
        model_parallel = self.model_parallel_size
        if self.num_actor_ranks % model_parallel:
            raise ConfigError(
                "num_actor_ranks",
                f"got {self.num_actor_ranks}; must be a multiple of TP * PP * CP = {model_parallel}",
            )
        if self.data_parallel_size is not None and model_parallel * self.data_parallel_size != self.num_actor_ranks:
            raise ConfigError(
                "data_parallel_size",
                f"got {self.data_parallel_size}; TP * PP * CP * DP = {model_parallel * self.data_parallel_size} "
                f"must equal num_actor_ranks ({self.num_actor_ranks})",
            )
        expert_layout = self.resolved_expert_tensor_parallel_size * self.expert_model_parallel_size
        if self.num_actor_ranks % (expert_layout * self.pipeline_model_parallel_size):
            field = "expert_model_parallel_size" if self.expert_model_parallel_size > 1 else "expert_tensor_parallel_size"
            raise ConfigError(
                field,
                f"got {getattr(self, field)}; num_actor_ranks ({self.num_actor_ranks}) must be a multiple of "
                f"ETP * EP * PP = {expert_layout * self.pipeline_model_parallel_size}",
            )
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ConfigError(
                "sequence_parallel", "got True; sequence parallelism needs tensor_model_parallel_size > 1"
            )

    @property
    def model_parallel_size(self) -> int:
        """Ranks that hold one copy of the model: ``TP * PP * CP``."""
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size

    @property
    def resolved_expert_tensor_parallel_size(self) -> int:
        """``expert_tensor_parallel_size``, ``tensor_model_parallel_size`` when unset."""
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    @property
    def resolved_data_parallel_size(self) -> int:
        """``data_parallel_size``, derived from ``num_actor_ranks`` when unset."""
        return self.num_actor_ranks // self.model_parallel_size
