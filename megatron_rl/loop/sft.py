"""Supervised fine-tuning (``megatron-rl sft``): the RL run's Megatron actor trained on
prompt/response rows, the warm start an RL run then takes as ``model.checkpoint``. One step::

    the next data.rows_per_step rows --> a batch with the loss on the response tokens -->
      one optimizer step (MegatronActor.sft_step: the mean NLL of every response token,
      the fused lm-head loss at TP/PP/DP) --> metrics;
      every k steps: the eval rows' NLL, an atomic checkpoint

The pre-flight (:func:`sft_preflight`) checks the config, the architecture, the tokenizer,
every row and the checkpoint to resume from before any process starts, with the RL
pre-flight's own checks. Checkpoints hold the actor and the data cursor in one atomic
write, as an RL run's do; a run resumes from its latest (``trainer.resume``) and a stop
signal ends it after the step in progress, checkpointing it (``loop.stop``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_rl.actor.batch import prompt_response_batch
from megatron_rl.actor.group import ActorGroup
from megatron_rl.actor.spec import ActorSpec
from megatron_rl.config.lib import ConfigError, save_resolved, to_dict
from megatron_rl.config.rollout import RolloutConfig
from megatron_rl.config.sft import SFTRunConfig
from megatron_rl.data.loaders import load_sft_rows
from megatron_rl.data.sft import SFTExamples, SFTSource, encode_sft_rows
from megatron_rl.loop.builder import close_all, placements, start_ray
from megatron_rl.loop.preflight import (
    check_architecture,
    check_initial_weights,
    check_resume_fits,
    check_writable,
    load_tokenizer,
    resume_checkpoint,
)
from megatron_rl.loop.run_lock import lock_run_dir
from megatron_rl.loop.steps import StepLoop
from megatron_rl.observability import MetricsSink
from megatron_rl.storage.checkpoints import ResumeChoice, prune_checkpoints

__all__ = ["SFTPreflight", "SFTTrainer", "sft_actor_spec", "sft_preflight"]

_ACTOR_ROLLOUT = RolloutConfig(placement="colocated")
"""The rollout section an SFT actor is built with: temperature 1 (the eval NLL's log-probs;
the SFT loss uses 1 whatever it says) and, on a GPU cluster, no GPUs set aside for engines."""


def sft_actor_spec(config: SFTRunConfig) -> ActorSpec:
    """What every actor rank of an SFT run is built from: the RL run's sections, no loss
    section (the SFT objective is fixed) and no reference policy."""
    model = config.model
    return ActorSpec(
        architecture=model.hf_config if model.hf_config is not None else model.tiny.to_hf_config_dict(),
        model=model, parallel=config.parallel, trainer=config.trainer, actor=config.actor, rollout=_ACTOR_ROLLOUT,
    )  # fmt: skip


@dataclass(kw_only=True)
class SFTPreflight:
    """What the SFT pre-flight loaded and checked; the trainer uses it instead of loading again."""

    hf_config: dict[str, Any]
    tokenizer: Any
    train: SFTExamples
    eval: SFTExamples | None
    resume: ResumeChoice


def sft_preflight(config: SFTRunConfig) -> SFTPreflight:
    """Every check an SFT run can make before a process starts; raises ``ConfigError``,
    ``DataError`` or ``FileExistsError`` (``trainer.resume: never`` over checkpoints)."""
    from megatron_rl.rewards import RewardLoadError
    from megatron_rl.tasks import UnknownTaskError, get_task

    data = config.data
    try:  # the task gives the prompt style the RL run will render its prompts in
        task = get_task(data.task)
    except (UnknownTaskError, RewardLoadError) as e:
        raise ConfigError("data.task", str(e)) from None
    longest = data.max_sequence_tokens
    hf_config, _, _ = check_architecture(config, longest=longest, longest_field="data.max_sequence_tokens",
                                         longest_what="data.max_sequence_tokens")  # fmt: skip
    check_initial_weights(config)
    resume = resume_checkpoint(config)
    tokenizer = load_tokenizer(config, vocab_size=hf_config["vocab_size"])
    if not data.train_files:
        raise ConfigError("data.train_files", "is empty; the run has no training rows")
    keys = {"prompt_key": data.prompt_key, "response_key": data.response_key}
    encode = {"template": data.prompt_template, "style": task.prompt_style, "max_sequence_tokens": longest}
    try:
        train = encode_sft_rows(load_sft_rows(data.train_files, **keys), tokenizer, **encode)
        eval_ = encode_sft_rows(load_sft_rows(data.eval_files, **keys), tokenizer, **encode) if data.eval_files else None
    except ValueError as e:
        if "end-of-sequence" in str(e):
            raise ConfigError("model.tokenizer", str(e)) from None
        raise
    if resume.path is not None:
        check_resume_fits(config, resume, num_train_rows=len(train), spec=sft_actor_spec(config))
    check_writable(config.run_dir)
    return SFTPreflight(hf_config=hf_config, tokenizer=tokenizer, train=train, eval=eval_, resume=resume)


class SFTTrainer(StepLoop):
    """Runs ``trainer.num_steps`` SFT steps, resuming from the run's latest checkpoint.
    ``close()`` stops the actor ranks and releases the run directory."""

    def __init__(self, config: SFTRunConfig, *, checked: SFTPreflight | None = None):
        self.config = config
        checked = checked or sft_preflight(config)
        self.resume_from = checked.resume.path
        self.checkpoint_dir = config.run_dir / "checkpoints"
        pad = checked.tokenizer.pad_token_id
        self.source = SFTSource(checked.train, checked.eval, seed=config.trainer.seed, shuffle=config.data.shuffle,
                                pad_id=int(pad if pad is not None else checked.tokenizer.eos_token_id))  # fmt: skip
        self.placement = None
        self.actors: ActorGroup | None = None
        self.sink: MetricsSink | None = None
        self.lock = lock_run_dir(config.run_dir)
        try:
            save_resolved(config, config.run_dir)
            start_ray(config.run_dir)
            actor_group, _, self.placement = placements(config.parallel, _ACTOR_ROLLOUT)
            self.actors = ActorGroup(sft_actor_spec(config), actor_group)
            if config.model.initial_weights is not None:
                self.actors.load_initial_weights(config.model.initial_weights)
            self.sink = MetricsSink(config.run_dir, wandb_mode=config.logging.wandb_mode,
                                    project=config.logging.wandb_project, run_name=config.logging.run_name,
                                    config=to_dict(config))  # fmt: skip
        except BaseException:
            self.close()
            raise

    def train_one_step(self, step: int) -> dict[str, float]:
        start = time.perf_counter()
        batch = prompt_response_batch(self.source.next_examples(self.config.data.rows_per_step), pad_id=self.source.pad_id)
        metrics = self.actors.sft_step(batch)
        seconds = time.perf_counter() - start
        metrics["sft/response_tokens"] = float(batch.loss_mask.sum())
        metrics["sft/sequence_tokens_mean"] = float(batch.attention_mask.sum()) / batch.num_sequences
        metrics["timing_s/step"] = seconds
        metrics["throughput/tokens_per_s"] = float(batch.attention_mask.sum()) / max(seconds, 1e-9)
        return metrics

    def evaluate(self, step: int) -> dict[str, float]:
        """``eval/nll``: the mean negative log-likelihood per response token of the eval rows
        (the trained weights, temperature 1), in batches of ``data.rows_per_step`` rows."""
        examples, size = self.source.eval_examples(), self.config.data.rows_per_step
        total = count = 0.0
        for lo in range(0, len(examples), size):
            batch = prompt_response_batch(examples[lo : lo + size], pad_id=self.source.pad_id)
            logp = self.actors.compute_logprobs(batch).logp.double()
            total -= float((logp * batch.loss_mask).sum())
            count += float(batch.loss_mask.sum())
        return {"eval/nll": total / count, "eval/response_tokens": count} if count else {}

    def save_checkpoint(self) -> Path:
        """Actor and data cursor in one atomic write (``actor.checkpoint``; refused if the
        weights are not finite)."""
        t = self.config.trainer
        state = {"step": self.step, "sampler": self.source.state_dict(), **self.actors.state_dict()}
        path = Path(self.actors.save_checkpoint(str(self.checkpoint_dir / f"step_{self.step:06d}"), trainer_state=state))
        prune_checkpoints(self.checkpoint_dir, keep_last=t.keep_last_checkpoints, keep_every_steps=t.keep_every_steps)
        return path

    def resume(self) -> int:
        """Load the checkpoint ``trainer.resume`` names (checked by the pre-flight); the step to continue after."""
        step = 0
        if self.resume_from is not None:
            state = self.actors.load_checkpoint(str(self.resume_from))["trainer"]
            step = int(state["step"])
            self.source.load_state_dict(state["sampler"])
            self.actors.load_state_dict(state)
        # Lines after it (all, on a fresh start) are from a run that died: replayed now, logged once.
        self.sink.truncate_after(step)
        return step

    def close(self) -> None:
        """Flush the metrics, stop the actor ranks, release the run directory; every part is
        closed even if one fails (the first error is raised at the end)."""
        try:
            close_all(self.sink and self.sink.close, self.actors and self.actors.shutdown,
                      self.placement and self.placement.remove, self.lock and self.lock.release)
        finally:
            self.sink = self.actors = self.placement = self.lock = None
