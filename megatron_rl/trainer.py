"""The GRPO-family RL loop, top to bottom.

One step::

    prompts --> rollout pool --> rewards --> advantages --> actor update (old/reference
      log-probs, token-weight methods, optimizer steps) --> weight sync --> metrics;
      every k steps: eval, atomic checkpoint

With ``rollout.placement: colocated`` the engines sleep and the actor onloads its
gradient buffers and optimizer state around the update, and gives them up again before
the sync (``Trainer.time_shared``). With ``rollout.max_staleness: k >= 1`` (disaggregated)
the batches of the next steps are generated while the actor trains (``rollout_ahead.py``);
the loss corrects for their older weights with the truncated importance weights. Either
way a batch is scored right after its generation (``_produce``), ahead of its update
when the batch is. Ahead, the next step's update is also submitted to the actor as soon
as this step's sync is done (``_start_next``): the actor runs it while the driver logs
and evaluates this step, instead of waiting for the driver between updates; the order
of every update, sync and generation, and so every number, is unchanged.

The components are built by ``builder.py`` and do the work (``actor/``, ``rollout/``,
``rewards/``, ``data/``, ``observability/``, ``evaluate.py``); this file only drives
them and keeps what makes a run resumable: the step and the data cursor, saved with the
actor's checkpoint in one atomic write. A run stops on non-finite steps or weights, or a
reward failing on every response (the components raise); the step that stops it is logged.
"""

from __future__ import annotations

import time
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from megatron_rl.actor.ray_group import NonFiniteStepsError
from megatron_rl.actor.update import timed
from megatron_rl.algo import compute_advantages
from megatron_rl.builder import build_run
from megatron_rl.config import RunConfig
from megatron_rl.evaluate import evaluate
from megatron_rl.experience import Experience, build_experience
from megatron_rl.observability import ProgressLine, rollout_metrics
from megatron_rl.preflight import Preflight
from megatron_rl.rewards import AllRewardsFailedError, RewardErrorStreak, summarize
from megatron_rl.rollout.base import SamplingParams
from megatron_rl.rollout_ahead import RolloutAhead, RolloutBatch
from megatron_rl.seeding import rollout_seed

__all__ = ["AllRewardsFailedError", "NonFiniteStepsError", "Trainer"]


@dataclass(kw_only=True)
class _Started:
    """One step's update, prepared and submitted to the actor (maybe by the step before)."""

    step: int
    exp: Experience
    metrics: dict[str, float]
    """The step's rollout metrics so far."""
    timings: dict[str, float] = field(default_factory=dict)
    pending: Any = None
    """The actor's pending results (``ActorGroup.submit_update``)."""
    submitted_at: float = 0.0
    """``time.perf_counter()`` at the submission."""
    error: BaseException | None = None
    """Raised instead of updating (every reward failed): the step is logged, then the run stops."""


class Trainer:
    """Runs ``trainer.num_steps`` RL steps, resuming from the run's latest checkpoint."""

    def __init__(self, config: RunConfig, *, checked: Preflight | None = None):
        self.config = config
        self.parts = build_run(config, checked=checked)  # ``checked``: the pre-flight, if run already
        self.reward_errors = RewardErrorStreak(config.trainer.max_consecutive_reward_error_steps)
        self.time_shared = config.rollout.placement == "colocated"
        """Colocated engines and actor take turns on the devices: per step, generate ->
        engines sleep -> actor onloads its train state -> update -> actor offloads -> sync
        (wakes the engines' weights) -> engines wake (KV cache); each transition timed."""
        self.step = 0
        self.ahead: RolloutAhead | None = None
        """The batches of the coming steps (generated inline, or ahead with ``max_staleness``)."""
        self._next: _Started | Exception | None = None
        """The next step's update, submitted at the end of this one (see :meth:`_may_start_next`)."""

    def run(self) -> dict[str, float]:
        """Train to ``trainer.num_steps``; returns the last logged step's metrics."""
        cfg, r = self.config, self.parts
        self.step = self._resume()
        last: dict[str, float] = {}
        with ExitStack() as stack:
            progress = ProgressLine(cfg.trainer.num_steps, start_step=self.step)
            stack.callback(progress.close)
            self.ahead = RolloutAhead(self._produce, cursor=r.prompts.state_dict,
                                      max_staleness=cfg.rollout.max_staleness, first_step=self.step + 1,
                                      last_step=cfg.trainer.num_steps, synced_version=self.step)  # fmt: skip
            stack.callback(self.ahead.close)
            while self.step < cfg.trainer.num_steps:
                self.step += 1
                last = self.train_one_step(self.step)
                if cfg.trainer.eval_every_steps and self.step % cfg.trainer.eval_every_steps == 0:
                    last.update(self.evaluate(self.step))
                if self.step % cfg.logging.log_every_steps == 0 or self.step == cfg.trainer.num_steps:
                    r.sink.log(self.step, last)
                    progress.update(self.step, last)
                # After a skipped (non-finite) step the previous checkpoint stays the latest:
                # a run that is diverging must not push its last good state aside.
                if self._save_due(self.step) and r.actors.consecutive_nonfinite == 0:
                    self.save_checkpoint()
        return last

    def _save_due(self, step: int) -> bool:
        every, num_steps = self.config.trainer.save_every_steps, self.config.trainer.num_steps
        return bool((every and step % every == 0) or (step == num_steps and self.config.trainer.save_final))

    def close(self) -> None:
        self.parts.close()  # engines, actor ranks, reward workers; flushes the metrics

    def _produce(self, step: int) -> RolloutBatch:
        """Draw step ``step``'s prompts and generate their responses on the pool."""
        cfg, r = self.config, self.parts
        start = time.perf_counter()
        prompts = r.prompts.next_prompts(cfg.rollout.num_prompts_per_step)
        params = SamplingParams.from_rollout_config(
            cfg.rollout, seed=rollout_seed(cfg.trainer.seed, step), stop_token_ids=r.prompts.stop_token_ids
        )
        completions = r.pool.generate(prompts.token_ids, params)
        generated = time.perf_counter()
        # Scored and batched here, in the background with the generation when the batch is made ahead.
        n = cfg.rollout.num_samples_per_prompt
        responses = [r.prompts.decode(c.token_ids) for group in completions for c in group]
        ground_truths = [row.ground_truth for row in prompts.rows for _ in range(n)]
        texts = [text for text in prompts.texts for _ in range(n)]
        rewards = r.rewards.score(responses, ground_truths, texts)
        scored = time.perf_counter()
        exp = build_experience(prompts.token_ids, completions, pad_id=r.prompts.pad_id)
        return RolloutBatch(step=step, prompts=prompts, completions=completions, generate_s=generated - start,
                            rewards=rewards, reward_s=scored - generated, experience=exp)  # fmt: skip

    def _start(self, step: int) -> _Started:
        """Take step ``step``'s batch, compute its advantages and submit its update."""
        cfg, r = self.config, self.parts
        timings: dict[str, float] = {}
        rollout, waited = self.ahead.take(step)
        exp: Experience = rollout.experience
        timings["generate"] = rollout.generate_s  # ahead: in the background, during earlier updates
        if self.ahead.max_staleness:
            timings["actor_wait_rollout"] = waited
        if self.time_shared:  # the engines give the devices back to the actor for the update
            with timed(timings, "sleep"):
                r.pool.sleep()
            with timed(timings, "onload"):
                r.actors.onload_train_state()
        timings["reward"] = rollout.reward_s  # with the generation
        results = rollout.rewards
        scores, counters = summarize(results)
        rewards = torch.tensor(scores, dtype=torch.float64)
        advantages = self.compute_advantages(rewards, exp)
        metrics = rollout_metrics(
            rewards, success_score=r.task.reward.success_score, response_lengths=exp.response_lengths,
            weight_versions=exp.weight_versions, reward_counters=counters, actor_version=step - 1,
        )  # fmt: skip
        # Where in the data this step's prompts start (resumes continue it without a gap or a repeat).
        metrics.update({"data/epoch": float(rollout.cursor["epoch"]), "data/position": float(rollout.cursor["position"])})
        started = _Started(step=step, exp=exp, metrics=metrics, timings=timings)
        try:
            self.reward_errors.update(step, results)
        except AllRewardsFailedError as e:
            started.error = e
            return started
        started.submitted_at = time.perf_counter()
        started.pending = r.actors.submit_update(exp.actor_batch(advantages), step,
                                                 token_stats=cfg.logging.token_diagnostics)  # fmt: skip
        if not self.time_shared:  # (time-shared, the actor offloads its train state before the sync)
            r.weight_sync.prepare(step)
        return started

    def _may_start_next(self, step: int) -> bool:
        """Whether step ``step + 1``'s update may be submitted at the end of step ``step``: its
        batch is generated ahead (so it is not waiting for this step's weights), the actor
        keeps the devices (not time-shared), and nothing after this step reads the actor's
        state before the next update would change it (a checkpoint)."""
        return (
            self.ahead.max_staleness > 0 and not self.time_shared and step < self.config.trainer.num_steps
            and not self._save_due(step)
        )  # fmt: skip

    def _start_next(self, step: int) -> None:
        """Submit step ``step + 1``'s update now when allowed and its batch is ready."""
        if not (self._may_start_next(step) and self.ahead.ready(step + 1)):
            return
        try:
            self._next = self._start(step + 1)
        except Exception as exc:  # noqa: BLE001  (raised at its own step, after this one is logged)
            self._next = exc

    def train_one_step(self, step: int) -> dict[str, float]:
        r = self.parts
        start = time.perf_counter()
        ahead = self.ahead  # set up by run()
        started, self._next = self._next, None
        if isinstance(started, BaseException):  # raised while starting this step early: now it is its turn
            raise started
        if started is None:
            started = self._start(step)
        assert started.step == step, (started.step, step)
        exp, metrics, timings = started.exp, started.metrics, started.timings
        try:
            if started.error is not None:
                raise started.error
            metrics.update(r.actors.finish_update(started.pending))
            # From the submission (the step before's end, when started early) to the result.
            timings["update"] = time.perf_counter() - started.submitted_at
        except (NonFiniteStepsError, AllRewardsFailedError) as e:  # the step that stops the run is logged
            r.sink.log(step, {**metrics, "actor/step_skipped": 1.0, **getattr(e, "metrics", {})})
            raise
        if self.time_shared:
            with timed(timings, "offload"):
                r.actors.offload_train_state()
        with ahead.paused() as waited:  # the pool finishes the generation in flight first
            with timed(timings, "weight_sync"):  # into sleeping engines: only their weights wake
                metrics.update(self.sync_weights(version=step))
            # Before the generation resumes: the driver's thread is not sharing the
            # interpreter with an engine in the driver's process.
            self._start_next(step)
        ahead.synced(step)
        if ahead.max_staleness:
            timings["actor_wait_rollout"] += waited
            timings["rollout_wait_actor"] = ahead.pool_idle_s()
        if self.time_shared:
            with timed(timings, "wake"):
                r.pool.wake()

        metrics.update({f"timing_s/{k}": v for k, v in timings.items()})
        seconds = time.perf_counter() - start
        metrics["timing_s/step"] = seconds
        metrics["throughput/tokens_per_s"] = float(exp.response_lengths.sum()) / seconds
        return metrics

    def compute_advantages(self, rewards: torch.Tensor, exp: Experience) -> torch.Tensor:
        """``[N]`` response advantages (the actor applies any token reweighting later)."""
        return compute_advantages(rewards, exp.group_index, self.config.algorithm.advantage)

    def sync_weights(self, *, version: int) -> dict[str, float]:
        """The actor's weights into every engine as ``version`` (``weight_sync.WeightSync``)."""
        return self.parts.weight_sync.run(version)

    def evaluate(self, step: int) -> dict[str, float]:
        r, cfg = self.parts, self.config
        with self.ahead.paused() if self.ahead else nullcontext():  # the pool is evaluation's meanwhile
            return evaluate(pool=r.pool, prompts=r.prompts, task=r.task, rewards=r.rewards, rollout=cfg.rollout,
                            seed=cfg.trainer.seed, step=step)  # fmt: skip

    def save_checkpoint(self) -> Path:
        """Actor and driver state in one atomic write (``actor.checkpoint``; refused if weights are not finite)."""
        r = self.parts
        # The data cursor from before the oldest batch not trained yet: a resumed run draws
        # the prompts of batches generated ahead again (none lost, none trained twice).
        cursor = self.ahead.cursor() if self.ahead else r.prompts.state_dict()
        state = {"step": self.step, "sampler": cursor, **r.actors.state_dict()}
        state.update(self.reward_errors.state_dict())
        path = r.checkpoint_dir / f"step_{self.step:06d}"
        return Path(r.actors.save_checkpoint(str(path), trainer_state=state))

    def _resume(self) -> int:
        """Load the checkpoint ``trainer.resume`` names, sync the engines; the step to continue after."""
        r = self.parts
        step = 0
        if r.resume_from is not None:  # checked by the pre-flight: intact, with a trainer state
            state = r.actors.load_checkpoint(str(r.resume_from))["trainer"]
            step = int(state["step"])
            r.prompts.load_state_dict(state["sampler"])
            r.actors.load_state_dict(state)
            self.reward_errors.load_state_dict(state)
        # Lines after it (all, on a fresh start) are from a run that died: replayed now, logged once.
        r.sink.truncate_after(step)
        # A fresh run's engines already start from the actor's initial weights, unless they
        # must run on FP8 ones from the first step.
        if step > 0 or self.config.rollout.weight_dtype == "fp8":
            self.sync_weights(version=step)
        if self.time_shared:  # the engines generate first
            r.actors.offload_train_state()
        return step
