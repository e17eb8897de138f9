"""The synchronous GRPO-family loop, top to bottom. One step::

    prompts --> rollout pool --> rewards --> advantages --> actor update (old/reference
      log-probs, token-weight methods, optimizer steps) --> weight sync --> metrics;
      every k steps: eval, atomic checkpoint

With ``rollout.placement: colocated`` the engines sleep and the actor onloads its
gradient buffers and optimizer state around the update, and gives them up again before
the sync. Runs that generate ahead of the update (``rollout.max_staleness >= 1``) use the
pipelined loop in ``pipeline.py``, which reuses this one's pieces; :func:`make_trainer`
there picks the loop for a config.

The components are built by ``builder.py`` and do the work; this file only drives them
(the step/eval/log/checkpoint schedule is ``steps.py``'s, shared with SFT) and keeps what
makes a run resumable: the step and the data cursor, saved with the
actor's checkpoint in one atomic write. A run stops on non-finite steps or weights, or a
reward failing on every response (the components raise); the step that stops it is logged.
A stop signal (``stop.py``) ends the run after the step in progress, checkpointing it.
"""

from __future__ import annotations

import time
from pathlib import Path

from megatron_rl.actor.group import NonFiniteStepsError
from megatron_rl.actor.update import timed
from megatron_rl.config.lib import ConfigError
from megatron_rl.config.run import RunConfig
from megatron_rl.loop.builder import build_run
from megatron_rl.loop.evaluate import evaluate
from megatron_rl.loop.experience import collect
from megatron_rl.loop.preflight import Preflight
from megatron_rl.loop.step import finish_update, step_metrics, submit_update
from megatron_rl.loop.steps import StepLoop
from megatron_rl.loop.warm import WarmWorkers
from megatron_rl.rewards import AllRewardsFailedError, RewardErrorStreak
from megatron_rl.storage.checkpoints import prune_checkpoints

__all__ = ["AllRewardsFailedError", "NonFiniteStepsError", "Trainer"]


class Trainer(StepLoop):
    """Runs ``trainer.num_steps`` RL steps, resuming from the run's latest checkpoint."""

    generates_ahead = False
    """Whether this loop generates batches ahead of the update (``rollout.max_staleness``)."""

    def __init__(self, config: RunConfig, *, checked: Preflight | None = None, warm: WarmWorkers | None = None):
        if config.rollout.max_staleness and not self.generates_ahead:
            raise ConfigError("rollout.max_staleness", f"{config.rollout.max_staleness}: this loop generates each "
                              "batch on the newest weights; use loop.pipeline.make_trainer")  # fmt: skip
        self.config = config
        self.parts = build_run(config, checked=checked, warm=warm)  # the pre-flight, if run; kept processes
        self.reward_errors = RewardErrorStreak(config.trainer.max_consecutive_reward_error_steps)
        self.time_shared = config.rollout.placement == "colocated"

    @property
    def sink(self):
        return self.parts.sink

    @property
    def actors(self):
        return self.parts.actors

    def train_one_step(self, step: int) -> dict[str, float]:
        r, start = self.parts, time.perf_counter()
        batch = collect(r, step)
        timings = {"generate": batch.generate_s}
        if self.time_shared:  # the engines give the devices back to the actor for the update
            with timed(timings, "sleep"):
                r.pool.sleep()
            with timed(timings, "onload"):
                r.actors.onload_train_state()
        started = submit_update(r, batch, timings, self.reward_errors, prepare_sync=not self.time_shared)
        metrics = finish_update(r, started)
        if self.time_shared:
            with timed(timings, "offload"):
                r.actors.offload_train_state()
        with timed(timings, "weight_sync"):  # into sleeping engines: only their weights wake
            metrics.update(r.weight_sync.run(step))
        if self.time_shared:
            with timed(timings, "wake"):
                r.pool.wake()
        return step_metrics(metrics, timings, batch.experience, start)

    def data_cursor(self) -> dict:
        """The data cursor a checkpoint stores: nothing is drawn ahead here."""
        return self.parts.prompts.state_dict()

    def evaluate(self, step: int) -> dict[str, float]:
        r, cfg = self.parts, self.config
        return evaluate(pool=r.pool, prompts=r.prompts, task=r.task, rewards=r.rewards, rollout=cfg.rollout,
                        seed=cfg.trainer.seed, step=step)  # fmt: skip

    def save_checkpoint(self) -> Path:
        """Actor and driver state in one atomic write (``actor.checkpoint``; refused if weights are not finite)."""
        r, t = self.parts, self.config.trainer
        state = {"step": self.step, "sampler": self.data_cursor(), **r.actors.state_dict(), **self.reward_errors.state_dict()}
        path = Path(r.actors.save_checkpoint(str(r.checkpoint_dir / f"step_{self.step:06d}"), trainer_state=state))
        prune_checkpoints(r.checkpoint_dir, keep_last=t.keep_last_checkpoints, keep_every_steps=t.keep_every_steps)
        return path

    def resume(self) -> int:
        """Load the checkpoint ``trainer.resume`` names, sync the engines; the step to continue after."""
        r, step = self.parts, 0
        if r.resume_from is not None:  # checked by the pre-flight: intact, with a trainer state
            state = r.actors.load_checkpoint(str(r.resume_from))["trainer"]
            step = int(state["step"])
            r.prompts.load_state_dict(state["sampler"])
            r.actors.load_state_dict(state)
            self.reward_errors.load_state_dict(state)
        # Lines after it (all, on a fresh start) are from a run that died: replayed now, logged once.
        r.sink.truncate_after(step)
        # Engines that started from the run's HF directory hold version 0 already, unless
        # they must run on FP8 ones; engines started from a config alone wait for it.
        if step > 0 or r.engines_await_weights or self.config.rollout.weight_dtype == "fp8":
            r.weight_sync.run(step)
        if self.time_shared:  # the engines generate first
            r.actors.offload_train_state()
        return step

    def close(self) -> None:
        self.parts.close()  # engines, actor ranks, reward workers; flushes the metrics
