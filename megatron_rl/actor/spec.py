"""What every rank of the Megatron actor is built from: the run's sections, by reference.

The builder fills an :class:`ActorSpec` from the run config once; every rank receives it
at construction (the actor never reads a whole ``RunConfig``, and no setting is copied
into an actor-specific class). The values derived from several sections live here as
properties: the optimizer-step count of the run (for the LR schedule), whether a
reference policy is needed, the temperature of the old-policy log-probs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megatron_rl.algo import AlgorithmConfig, update_phases
from megatron_rl.config.model import ModelOptions
from megatron_rl.config.parallel import ParallelConfig
from megatron_rl.config.rollout import RolloutConfig
from megatron_rl.config.trainer import ActorConfig, TrainerConfig

__all__ = ["ActorSpec"]


@dataclass(kw_only=True)
class ActorSpec:
    """The actor's inputs: the architecture plus references to the run's sections."""

    architecture: Any
    """The HF architecture (derived from the ``model`` section): a HF model directory, its
    ``config.json`` path, a config dict or a ``PretrainedConfig``; dispatched on ``model_type``."""

    model: ModelOptions = field(default_factory=ModelOptions)
    """Numerics: dtype, Transformer Engine, FP8, vocabulary padding (the ``model`` section)."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """TP / PP sizes (the ``parallel`` section); DP follows from the world size."""

    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The optimizer (``OptimConfig``, which ``TrainerConfig`` extends), the update
    schedule (mini-batches, epochs), the micro-batch budget and the seed."""

    actor: ActorConfig = field(default_factory=ActorConfig)
    """Optimizer sharding, checkpoint format, loss chunking (the ``actor`` section)."""

    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """The loss (the ``algorithm`` section)."""

    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Sampling temperature (the old policy's log-probs use it) and the TIS cap."""

    @property
    def temperature(self) -> float:
        """Logits are divided by the rollout temperature in every log-prob and loss."""
        return self.rollout.temperature

    @property
    def lora(self):
        """The adapters every rank builds (``models.lora.LoRASettings`` from ``actor.lora``,
        A seeded by ``trainer.seed``), or None without LoRA."""
        config = self.actor.lora
        if config is None:
            return None
        from megatron_rl.models.lora import LoRASettings

        return LoRASettings(rank=config.rank, alpha=config.alpha, dropout=config.dropout, seed=self.trainer.seed,
                            target_modules=tuple(config.target_modules))  # fmt: skip

    @property
    def with_reference(self) -> bool:
        """Whether the loss needs a reference policy's log-probs (a KL term)."""
        return self.algorithm.needs_ref_logp

    @property
    def optimizer_steps_per_rl_step(self) -> int:
        """Update phases x epochs x mini-batches: optimizer steps of one RL step."""
        trainer = self.trainer
        return len(update_phases(self.algorithm)) * trainer.num_epochs_per_step * trainer.num_minibatches_per_step

    @property
    def lr_decay_steps(self) -> int:
        """Optimizer steps of the whole run, over which cosine/linear schedules decay."""
        return self.trainer.num_steps * self.optimizer_steps_per_rl_step
