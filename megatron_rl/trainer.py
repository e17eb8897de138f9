"""The GRPO-family RL loop, top to bottom.

One step:

    prompts --> rollout pool --> rewards --> advantages --> old (and reference) log-probs
      --> [AR weights, inside the actor] --> train steps (Lopti: low pass, then high pass)
      --> weight sync --> metrics; every k steps: eval, atomic checkpoint

Everything heavy lives in the components (``actor/``, ``rollout/``, ``rewards/``,
``data/``, ``observability/``); this file only wires them (``trainer_setup.py`` builds
them from the config) and keeps the bookkeeping that makes a run resumable: the step,
the data cursor and the per-step seeds, saved atomically with the actor's checkpoint.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch

from megatron_rl.algo import broadcast_to_tokens, compute_advantages
from megatron_rl.config import RunConfig
from megatron_rl.experience import Experience, build_experience, minibatch_rows
from megatron_rl.observability import ProgressLine, token_probability_diagnostics
from megatron_rl.rewards import score_batch
from megatron_rl.rollout.base import SamplingParams, derive_seed
from megatron_rl.rollout.mismatch import logprob_mismatch
from megatron_rl.trainer_setup import Components, build_components


class NonFiniteStepsError(RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradient norm."""


class Trainer:
    """Runs ``config.trainer.num_steps`` RL steps, resuming from the run's latest checkpoint."""

    def __init__(self, config: RunConfig):
        self.config = config
        self.c: Components = build_components(config)
        self.step = 0
        self.consecutive_nonfinite = 0

    # ------------------------------------------------------------------ the loop

    def run(self) -> dict[str, float]:
        """Train to ``trainer.num_steps``; returns the last logged step's metrics."""
        cfg, c = self.config, self.c
        self.step = self._resume()
        progress = ProgressLine(cfg.trainer.num_steps, start_step=self.step)
        last: dict[str, float] = {}
        try:
            while self.step < cfg.trainer.num_steps:
                self.step += 1
                last = self.train_one_step(self.step)
                if cfg.trainer.eval_every_steps and self.step % cfg.trainer.eval_every_steps == 0:
                    last.update(self.evaluate(self.step))
                if self.step % cfg.logging.log_every_steps == 0 or self.step == cfg.trainer.num_steps:
                    c.sink.log(self.step, last)
                    progress.update(self.step, last)
                save_every = cfg.trainer.save_every_steps
                due = (save_every and self.step % save_every == 0) or self.step == cfg.trainer.num_steps
                # After a skipped (non-finite) step the previous checkpoint stays the latest:
                # a run that is diverging must not push its last good state aside.
                if due and self.consecutive_nonfinite == 0:
                    self.save_checkpoint()
        finally:
            progress.close()
        return last

    def close(self) -> None:
        """Stop the engines, actor ranks and reward workers; flush the metrics."""
        self.c.close()

    def train_one_step(self, step: int) -> dict[str, float]:
        cfg, c = self.config, self.c
        timings: dict[str, float] = {}
        t_step = time.perf_counter()

        with _timer(timings, "generate"):
            rows = [c.train_rows[i] for i in c.sampler.next_indices(cfg.rollout.num_prompts_per_step)]
            prompt_texts, prompt_ids = c.encode_prompts(rows)
            params = SamplingParams.from_rollout_config(
                cfg.rollout, seed=derive_seed(cfg.trainer.seed, step), stop_token_ids=c.stop_token_ids
            )
            completions = c.pool.generate(prompt_ids, params)
            exp = build_experience(prompt_ids, completions, pad_id=c.pad_id)
        with _timer(timings, "reward"):
            n = cfg.rollout.num_samples_per_prompt
            responses = [c.decode(comp.token_ids) for group in completions for comp in group]
            scores, reward_metrics = score_batch(
                c.reward, responses, [r.ground_truth for r in rows for _ in range(n)],
                prompts=[p for p in prompt_texts for _ in range(n)], pool=c.reward_pool,
            )  # fmt: skip
            rewards = torch.tensor(scores, dtype=torch.float64)
            advantages = self.compute_advantages(rewards, exp)
        with _timer(timings, "logprobs"):
            batch = exp.batch
            old = c.actors.compute_logprobs(batch, cfg.rollout.temperature)
            ref = None
            if cfg.algorithm.needs_ref_logp:
                ref = c.actors.compute_logprobs(batch, cfg.rollout.temperature, policy="reference").logp
            mismatch = logprob_mismatch(exp.engine_logp, old.logp, batch.loss_mask, tis_cap=cfg.rollout.tis_cap)
            if mismatch.tis_weights is not None:
                advantages = advantages * mismatch.tis_weights
            batch = replace(batch, old_logp=old.logp, ref_logp=ref, advantages=advantages)
        with _timer(timings, "train"):
            train_metrics, grad_norms = self.update_policy(batch, step)
        with _timer(timings, "weight_sync"):
            sync_metrics = c.sync_weights(version=step)

        metrics = {f"timing_s/{k}": v for k, v in timings.items()}
        metrics.update(_reward_metrics(rewards, c.reward.success_score, exp, reward_metrics))
        metrics.update(mismatch.metrics)
        metrics.update(train_metrics)
        metrics.update({k: float(v) for k, v in sync_metrics.items()})
        if cfg.logging.token_diagnostics:
            with _timer(timings, "diagnostics"):
                new = c.actors.compute_logprobs(batch, cfg.rollout.temperature)
                metrics.update(
                    token_probability_diagnostics(
                        old.logp, batch.loss_mask, logit_grad_norm=grad_norms, new_logp=new.logp
                    )
                )
            metrics["timing_s/diagnostics"] = timings["diagnostics"]
        seconds = time.perf_counter() - t_step
        metrics["timing_s/step"] = seconds
        metrics["throughput/tokens_per_s"] = float(exp.response_lengths.sum()) / seconds
        metrics["throughput/train_tokens_per_s"] = float(batch.attention_mask.sum()) / max(timings["train"], 1e-9)
        return metrics

    def compute_advantages(self, rewards: torch.Tensor, exp: Experience) -> torch.Tensor:
        """``[N, L]`` token advantages (before AR, which the actor applies from ``old_logp``)."""
        adv = compute_advantages(rewards, exp.group_index, self.config.algorithm.advantage)
        return broadcast_to_tokens(adv, exp.batch.loss_mask)

    def update_policy(self, batch, step: int) -> tuple[dict[str, float], torch.Tensor | None]:
        """All optimizer steps of one RL step: Lopti's two passes (low probability FIRST)
        or one, each over ``num_epochs_per_step`` x ``num_minibatches_per_step`` mini-batches.

        Returns the updates' metrics (means over updates; ``actor/step_skipped`` summed) and
        the per-token logit-gradient norms of the first pass (for the diagnostics)."""
        cfg, c = self.config, self.c
        phases = ["low", "high"] if cfg.algorithm.lopti.enabled else [None]
        sums: dict[str, float] = defaultdict(float)
        updates = 0
        grad_norms = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
        for p, phase in enumerate(phases):
            for epoch in range(cfg.trainer.num_epochs_per_step):
                seed = derive_seed(cfg.trainer.seed, step, 7919 * p + epoch)
                for rows in minibatch_rows(batch.num_sequences, cfg.trainer.num_minibatches_per_step, seed=seed):
                    want_norms = cfg.logging.token_diagnostics and p == 0 and epoch == 0
                    m, norms = c.actors.train_step(
                        batch.select(rows), cfg.algorithm, temperature=cfg.rollout.temperature,
                        lopti_phase=phase, token_grad_norms=want_norms,
                    )  # fmt: skip
                    if norms is not None:
                        grad_norms[rows] = norms
                    for k, v in m.items():
                        sums[k] += v
                    updates += 1
        skipped = sums.get("actor/step_skipped", 0.0)
        out = {k: v / updates for k, v in sums.items()}
        out["actor/step_skipped"] = skipped
        out["actor/updates"] = float(updates)
        self.consecutive_nonfinite = self.consecutive_nonfinite + 1 if skipped else 0
        if self.consecutive_nonfinite >= cfg.trainer.max_consecutive_nonfinite_steps:
            raise NonFiniteStepsError(
                f"{self.consecutive_nonfinite} consecutive steps had a non-finite loss or gradient norm "
                f"(trainer.max_consecutive_nonfinite_steps={cfg.trainer.max_consecutive_nonfinite_steps}); "
                "stopping with the last good checkpoint intact"
            )
        return out, grad_norms

    # ------------------------------------------------------------------ eval

    def evaluate(self, step: int) -> dict[str, float]:
        """Accuracy (share of responses scoring at least the reward's ``success_score``) on
        the eval prompts, per group (``num_people`` for K&K), greedy and sampled."""
        cfg, c = self.config, self.c
        if not c.eval_rows:
            return {}
        t0 = time.perf_counter()
        texts, ids = c.encode_prompts(c.eval_rows)
        groups = [f"n{r.metadata['num_people']}" if "num_people" in r.metadata else "all" for r in c.eval_rows]
        out: dict[str, float] = {}
        for mode, temperature in (("greedy", 0.0), ("sampled", cfg.rollout.temperature)):
            params = replace(
                SamplingParams.from_rollout_config(
                    cfg.rollout, seed=derive_seed(cfg.trainer.seed, step, 104729), stop_token_ids=c.stop_token_ids
                ),
                n=1,
                temperature=temperature,
            )
            completions = c.pool.generate(ids, params)
            responses = [c.decode(group[0].token_ids) for group in completions]
            scores, _ = score_batch(
                c.reward, responses, [r.ground_truth for r in c.eval_rows], prompts=texts, pool=c.reward_pool
            )
            hits: dict[str, list[float]] = defaultdict(list)
            for g, s in zip(groups, scores):
                hits[g].append(float(s >= c.reward.success_score))
            for g, h in sorted(hits.items()):
                out[f"eval/accuracy/{g}/{mode}"] = sum(h) / len(h)
            out[f"eval/accuracy/mean/{mode}"] = sum(sum(h) for h in hits.values()) / len(scores)
            out[f"eval/reward/mean/{mode}"] = sum(scores) / len(scores)
        out["eval/accuracy/mean"] = out["eval/accuracy/mean/greedy"]
        out["timing_s/eval"] = time.perf_counter() - t0
        return out

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self) -> Path:
        """Actor state and the driver's state in one atomic write (see ``actor.checkpoint``)."""
        state = {
            "step": self.step,
            "sampler": self.c.sampler.state_dict(),
            "consecutive_nonfinite": self.consecutive_nonfinite,
        }
        path = self.c.checkpoint_dir / f"step_{self.step:06d}"
        return Path(self.c.actors.save_checkpoint(str(path), trainer_state=state))

    def _resume(self) -> int:
        """Load the checkpoint ``trainer.resume`` points at (``auto``: the run's latest) and
        bring the engines to its weights; returns the step to continue after."""
        c = self.c
        source = c.resume_source
        step = 0
        if source is not None:
            record = c.actors.load_checkpoint(str(source))
            state = record.get("trainer")
            if state is None:
                raise ValueError(f"checkpoint {source} holds no trainer state (not written by the trainer)")
            step = int(state["step"])
            c.sampler.load_state_dict(state["sampler"])
            self.consecutive_nonfinite = int(state.get("consecutive_nonfinite", 0))
            c.sink.truncate_after(step)
        c.sync_weights(version=step)
        return step


def _timer(timings: dict[str, float], name: str):
    class _T:
        def __enter__(self):
            self.t0 = time.perf_counter()

        def __exit__(self, *exc):
            timings[name] = timings.get(name, 0.0) + time.perf_counter() - self.t0

    return _T()


def _reward_metrics(rewards: torch.Tensor, success: float, exp: Experience, extra: dict) -> dict[str, float]:
    lengths = exp.response_lengths.double()
    out = {
        "rollout/reward/mean": float(rewards.mean()),
        "rollout/reward/std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "rollout/reward/min": float(rewards.min()),
        "rollout/reward/max": float(rewards.max()),
        "rollout/success_rate": float((rewards >= success).double().mean()),
        "rollout/response_length/mean": float(lengths.mean()),
        "rollout/response_length/max": float(lengths.max()),
        "rollout/weight_version/min": float(min(exp.weight_versions)),
    }
    out.update({k: float(v) for k, v in extra.items() if isinstance(v, (int, float)) and math.isfinite(v)})
    return out
