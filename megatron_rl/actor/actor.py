"""The Megatron actor: one process per rank, TP/PP/DP training with the fused policy loss.

``MegatronActor`` owns one pipeline stage's ``GPTModel`` shard wrapped in megatron DDP,
the megatron optimizer (DistributedOptimizer by default) and its LR scheduler. Its
methods are collective: every rank of the world calls them with the SAME full batch
(the trainer broadcasts it; a Ray actor per rank receives a copy). Each DP rank takes
the rows ``dp_rank::dp_size`` of it; TP and PP ranks of a replica work on the same rows.

Per-token alignment, padding and micro-batching: see ``megatron_rl.actor.batch``.

Loss normalisation (megatron's ``calculate_per_token_loss`` contract): the loss function
of a micro-batch returns ``(loss_sum, count, report)`` from the fused vocab-parallel op;
megatron DDP SUMS gradients over DP and ``finalize_model_grads`` divides them by the
global count (summed over micro-batches, broadcast from the last stage over PP,
all-reduced over DP). The gradient is therefore that of ``sum(loss) / sum(count)`` over
the whole mini-batch, independent of the micro-batch and DP split (``count`` follows
``algorithm.aggregation``: valid tokens for ``token_mean``, sequences for the seq-mean
modes, ...). The reported loss is the same ratio computed from the reports.

Optimizer step: megatron's ``prepare_grads`` / ``get_grad_norm`` / clip / ``step_with_ready_grads``
sequence, with one extra rule: if the global loss or the gradient norm is not finite the
update is skipped (weights, Adam moments and step, LR schedule untouched) and counted.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from megatron_rl.actor import checkpoint as ckpt
from megatron_rl.actor import cpu_shim
from megatron_rl.actor.batch import ActorBatch, MicroBatch, make_microbatches
from megatron_rl.actor.launch import ProcessGroups, initialize_parallel
from megatron_rl.actor.model import ModelOptions, build_gpt_model, build_transformer_config, load_hf_config
from megatron_rl.actor.weights import iter_hf_weights, load_hf_weights
from megatron_rl.algo import (
    AlgorithmConfig,
    finalize_metrics,
    lopti_split,
    merge_metrics,
    prepare_advantages,
    stapo_candidates,
    stapo_entropy_threshold,
)
from megatron_rl.models import adapter_for_config, padded_vocab_size
from megatron_rl.ops import LossInputs, VocabParallelOptions, fused_policy_loss, vocab_parallel_logprobs

__all__ = ["ActorConfig", "LogProbs", "MegatronActor"]


@dataclass(kw_only=True)
class ActorConfig:
    """Everything a ``MegatronActor`` needs; :meth:`from_run_config` fills it from a RunConfig."""

    hf_config: Any
    """Architecture: a HF model directory, its ``config.json`` path, a config dict or a
    ``PretrainedConfig``. Dispatched on ``model_type`` (qwen2, qwen3, llama)."""

    tensor_model_parallel_size: int = 1
    """TP size; must divide attention heads, key/value heads and the world size."""

    pipeline_model_parallel_size: int = 1
    """PP size; must divide the layer count (megatron splits layers evenly)."""

    model: ModelOptions = field(default_factory=ModelOptions)
    """dtype, Transformer-Engine spec and FP8 options."""

    lr: float = 1e-6
    """Peak learning rate (Adam)."""

    min_lr: float = 0.0
    """Final learning rate of the cosine / linear schedules."""

    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    """Decay style after warm-up (megatron's ``OptimizerParamScheduler``)."""

    lr_warmup_steps: int = 0
    """Optimizer steps of linear warm-up from 0 to ``lr``."""

    lr_decay_steps: int | None = None
    """Optimizer steps over which cosine / linear decay to ``min_lr``; required by them."""

    weight_decay: float = 0.01
    """Decoupled (AdamW) weight decay."""

    adam_beta1: float = 0.9
    """Adam's first-moment decay."""

    adam_beta2: float = 0.999
    """Adam's second-moment decay."""

    adam_eps: float = 1e-8
    """Adam's denominator epsilon."""

    grad_clip: float | None = 1.0
    """Clip the global gradient norm to this value; ``None`` disables clipping."""

    max_tokens_per_microbatch: int = 4096
    """Padded-token budget of one micro-batch (sequences x its longest length)."""

    use_distributed_optimizer: bool = True
    """Shard optimizer state over DP (megatron DistributedOptimizer)."""

    seed: int = 1234
    """Seed of initialisation and dropout streams (see ``launch.set_seed``)."""

    logits_chunk_tokens: int | None = None
    """Tokens per chunk in the fused loss (``None``: about 4 MiB of float32 logits)."""

    checkpoint_optimizer_sharding: Literal["dp_reshardable", "fully_reshardable"] = "dp_reshardable"
    """Optimizer-state format of saved checkpoints: ``dp_reshardable`` (no gathering;
    reshards over DP only) or ``fully_reshardable`` (gathered per parameter; loads at any
    TP/PP/DP). See ``actor.checkpoint``."""

    def __post_init__(self) -> None:
        if self.tensor_model_parallel_size < 1 or self.pipeline_model_parallel_size < 1:
            raise ValueError("parallel sizes must be >= 1")
        if self.lr_schedule != "constant" and self.lr_decay_steps is None:
            raise ValueError(f"lr_schedule={self.lr_schedule!r} needs lr_decay_steps")
        if self.max_tokens_per_microbatch < 1:
            raise ValueError("max_tokens_per_microbatch must be >= 1")

    @classmethod
    def from_run_config(cls, run, *, optimizer_steps: int | None = None) -> "ActorConfig":
        """From a ``megatron_rl.config.RunConfig``; ``optimizer_steps`` (total updates of the
        run) sets ``lr_decay_steps``; by default it is derived from the trainer section."""
        model, trainer = run.model, run.trainer
        hf = model.hf_config if model.hf_config is not None else model.tiny.to_hf_config_dict()
        if optimizer_steps is None:
            passes = 2 if run.algorithm.lopti.enabled else 1
            optimizer_steps = trainer.num_steps * trainer.num_minibatches_per_step * trainer.num_epochs_per_step * passes
        return cls(
            hf_config=hf,
            tensor_model_parallel_size=run.parallel.tensor_model_parallel_size,
            pipeline_model_parallel_size=run.parallel.pipeline_model_parallel_size,
            model=ModelOptions(dtype=model.dtype),
            lr=trainer.lr,
            min_lr=trainer.min_lr,
            lr_schedule=trainer.lr_schedule,
            lr_warmup_steps=trainer.lr_warmup_steps,
            lr_decay_steps=optimizer_steps,
            weight_decay=trainer.weight_decay,
            adam_beta1=trainer.adam_beta1,
            adam_beta2=trainer.adam_beta2,
            adam_eps=trainer.adam_eps,
            grad_clip=trainer.grad_clip,
            max_tokens_per_microbatch=trainer.max_tokens_per_microbatch,
            seed=trainer.seed,
        )


@dataclass(kw_only=True)
class LogProbs:
    """Per-token results of :meth:`MegatronActor.compute_logprobs`, aligned with ``input_ids``."""

    logp: torch.Tensor
    """``[N, L]`` float32 ``log p(input_ids[:, t] | input_ids[:, :t])`` at the temperature; 0 at
    column 0 and on padding."""
    entropy: torch.Tensor
    """``[N, L]`` float32 entropy of the next-token distribution that predicted token ``t``."""


class MegatronActor:
    """One rank of the actor. Construct on every rank of an initialised process group."""

    def __init__(self, config: ActorConfig, *, groups: ProcessGroups | None = None):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        self.config = config
        self.hf_source_dir = _source_dir(config.hf_config)
        self.hf_config = load_hf_config(config.hf_config)
        self.adapter = adapter_for_config(self.hf_config)
        tp, pp = config.tensor_model_parallel_size, config.pipeline_model_parallel_size
        self.groups = groups or initialize_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, seed=config.seed
        )
        if (self.groups.tp_size, self.groups.pp_size) != (tp, pp):
            raise ValueError(f"groups are TP={self.groups.tp_size} PP={self.groups.pp_size}; config says TP={tp} PP={pp}")
        self.vocab_size = int(self.hf_config["vocab_size"])
        self.padded_vocab_size = padded_vocab_size(
            self.vocab_size, tp_size=tp, divisible_by=config.model.make_vocab_size_divisible_by
        )
        self.transformer_config = build_transformer_config(
            self.hf_config, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, options=config.model
        )
        self.model = build_gpt_model(
            self.hf_config,
            self.transformer_config,
            pre_process=self.groups.is_first_stage,
            post_process=self.groups.is_last_stage,
            options=config.model,
            adapter=self.adapter,
        )
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=config.use_distributed_optimizer,
        )
        with cpu_shim.cuda_to_cpu():
            self.ddp = DistributedDataParallel(config=self.transformer_config, ddp_config=ddp_config, module=self.model)
        # The schedules read these from the model config: no grad sync until the last
        # micro-batch, then DP reduction, embedding-grad sync and the division by the
        # global token count.
        self.transformer_config.no_sync_func = self.ddp.no_sync
        self.transformer_config.finalize_model_grads_func = finalize_model_grads
        bf16 = config.model.torch_dtype == torch.bfloat16
        optimizer_config = OptimizerConfig(
            optimizer="adam",
            lr=config.lr,
            min_lr=config.min_lr,
            weight_decay=config.weight_decay,
            adam_beta1=config.adam_beta1,
            adam_beta2=config.adam_beta2,
            adam_eps=config.adam_eps,
            clip_grad=config.grad_clip or 0.0,
            bf16=bf16,
            params_dtype=config.model.torch_dtype,
            use_distributed_optimizer=config.use_distributed_optimizer,
        )
        with cpu_shim.cuda_to_cpu():
            self.optimizer = get_megatron_optimizer(optimizer_config, [self.ddp])
        decay_steps = max(config.lr_decay_steps or 1, config.lr_warmup_steps + 1)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0 if config.lr_warmup_steps > 0 else config.lr,
            max_lr=config.lr,
            min_lr=config.min_lr,
            lr_warmup_steps=config.lr_warmup_steps,
            lr_decay_steps=decay_steps,
            lr_decay_style=config.lr_schedule,
            start_wd=config.weight_decay,
            end_wd=config.weight_decay,
            wd_incr_steps=decay_steps,
            wd_incr_style="constant",
        )
        self.train_steps = 0
        """``train_step`` calls so far (skipped ones included)."""
        self.optimizer_steps = 0
        """Successful optimizer updates so far."""
        self.skipped_steps = 0
        self.last_token_grad_norms: torch.Tensor | None = None
        """Updates skipped for a non-finite loss or gradient norm."""

    # ------------------------------------------------------------------ helpers

    def _local_rows(self, n: int) -> torch.Tensor:
        if n < self.groups.dp_size:
            raise ValueError(f"batch of {n} sequences is smaller than the data-parallel size {self.groups.dp_size}")
        return torch.arange(self.groups.dp_rank, n, self.groups.dp_size)

    def _vocab_options(self, temperature: float) -> VocabParallelOptions:
        return VocabParallelOptions(
            temperature=temperature,
            tp_group=self.groups.tp if self.groups.tp_size > 1 else None,
            vocab_size=self.vocab_size,
            chunk_tokens=self.config.logits_chunk_tokens,
        )

    def _run_schedule(self, microbatches: list[MicroBatch], loss_func, *, forward_only: bool) -> list:
        """megatron's forward(-backward) schedule over ``microbatches``; returns the loss
        functions' reports (last stage; ``[]`` elsewhere)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            b, s = mb.input_ids.shape
            positions = torch.arange(s, device=mb.input_ids.device).expand(b, s)
            # labels=None: the last stage returns vocab-parallel logits [b, s, V/TP].
            output = model(mb.input_ids, positions, attention_mask=None)
            return output, partial(loss_func, mb)

        with cpu_shim.cuda_to_cpu():
            return get_forward_backward_func(pp_size=self.groups.pp_size)(
                forward_step_func=forward_step,
                data_iterator=iter(microbatches),
                model=[self.ddp],
                num_microbatches=len(microbatches),
                seq_length=max(mb.input_ids.shape[1] for mb in microbatches),
                micro_batch_size=max(mb.input_ids.shape[0] for mb in microbatches),
                forward_only=forward_only,
            )

    def _forward_logprobs(self, microbatches: list[MicroBatch], temperature: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Forward-only log-probs and entropies per micro-batch, target-aligned ``[b, s]``
        (last stage; ``[]`` elsewhere)."""
        options = self._vocab_options(temperature)

        def loss_func(mb: MicroBatch, logits: torch.Tensor):
            logp, entropy = vocab_parallel_logprobs(logits, mb.targets, mask=mb.target_mask, options=options)
            zero = torch.zeros((), dtype=torch.float32, device=logits.device)
            return zero, torch.zeros((), dtype=torch.int), {"logp": logp, "entropy": entropy}

        self.ddp.eval()
        with torch.no_grad():
            reports = self._run_schedule(microbatches, loss_func, forward_only=True)
        return [(r["logp"], r["entropy"]) for r in reports]

    # ------------------------------------------------------------------ log-probs

    def compute_logprobs(self, batch: ActorBatch, temperature: float = 1.0) -> LogProbs:
        """Per-token log-probs and entropies of ``batch`` under the current weights (no grad).

        ``logp[i, t] = log softmax(logits[i, t - 1] / temperature)[input_ids[i, t]]`` for
        every real token ``t >= 1`` (0 at column 0 and on padding); ``entropy`` is the full
        next-token distribution's entropy at the same temperature, same alignment.

        Returned on EVERY rank: the last pipeline stage computes its DP shard, the shards
        are all-gathered over DP and the result broadcast from the last stage over PP
        (TP ranks compute identical values). Collective over the world.
        """
        n, length = batch.input_ids.shape
        rows = self._local_rows(n)
        microbatches = make_microbatches(batch.select(rows), self.config.max_tokens_per_microbatch, device=_device())
        results = self._forward_logprobs(microbatches, temperature)
        full = self._gather_token_values(n, length, len(rows), microbatches, [[lp, h] for lp, h in results])
        return LogProbs(logp=full[0].cpu(), entropy=full[1].cpu())

    def _gather_token_values(
        self, n: int, length: int, num_local: int, microbatches: list[MicroBatch], values: list[list[torch.Tensor]]
    ) -> torch.Tensor:
        """Assemble per-micro-batch, target-aligned ``[b, s]`` values (last stage) into
        input-aligned ``[K, n, length]`` float32 on EVERY rank: shifted by one column, DP
        shards all-gathered over DP on the last stage, broadcast from it over PP."""
        k = len(values[0]) if values else 0
        k = int(self._broadcast_int(k))
        local = torch.zeros(k, num_local, length, dtype=torch.float32, device=_device())
        for mb, vals in zip(microbatches, values):
            s = mb.input_ids.shape[1]
            for j, v in enumerate(vals):
                # Target-aligned column t predicts input column t + 1.
                local[j, mb.rows, 1:s] = v.reshape(-1, s)[:, : s - 1].float()
        full = torch.zeros(k, n, length, dtype=torch.float32, device=_device())
        if self.groups.is_last_stage:
            per_rank = -(-n // self.groups.dp_size)
            padded = torch.zeros(k, per_rank, length, dtype=torch.float32, device=_device())
            padded[:, :num_local] = local
            gathered = [torch.empty_like(padded) for _ in range(self.groups.dp_size)]
            dist.all_gather(gathered, padded, group=self.groups.dp)
            for d, part in enumerate(gathered):
                count = len(range(d, n, self.groups.dp_size))
                full[:, d :: self.groups.dp_size] = part[:, :count]
        if self.groups.pp_size > 1:
            dist.broadcast(full, src=self.groups.last_stage_global_rank, group=self.groups.pp)
        return full

    def _broadcast_int(self, value: int) -> int:
        """``value`` from the last pipeline stage, on every rank of the PP group."""
        if self.groups.pp_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=_device())
        dist.broadcast(t, src=self.groups.last_stage_global_rank, group=self.groups.pp)
        return int(t)

    # ------------------------------------------------------------------ training

    def _stapo_threshold(
        self, microbatches: list[MicroBatch], algorithm: AlgorithmConfig, temperature: float, lopti_phase
    ) -> torch.Tensor | None:
        """STAPO's ``tau_h`` over the whole mini-batch: a forward-only pre-pass gives the
        current ``p`` and ``H`` (the weights do not change within the optimizer step, so
        they equal the loss's); candidates are gathered over the DP group. Last stage only."""
        results = self._forward_logprobs(microbatches, temperature)
        if not self.groups.is_last_stage:
            return None
        entropies = []
        for mb, (logp, entropy) in zip(microbatches, results):
            active = mb.loss_mask.bool()
            if algorithm.lopti.enabled:
                low, high = lopti_split(mb.old_logp, active, algorithm.lopti.eta)
                active = low if lopti_phase == "low" else high
            adv = torch.where(active, mb.advantages.to(logp.dtype), torch.zeros_like(logp))
            candidates = stapo_candidates(adv, logp, active, algorithm.stapo.tau_p)
            entropies.append(entropy[candidates])
        flat = torch.cat(entropies)
        return stapo_entropy_threshold(
            flat, torch.ones_like(flat, dtype=torch.bool), algorithm.stapo.entropy_quantile, group=self.groups.dp
        )

    def _reduce_reports(self, parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Sum ``{name: [sum, count]}`` reports over micro-batches and DP (last stage), then
        broadcast the result from the last stage over PP, so every rank holds it."""
        payload: list[Any] = [None]
        if self.groups.is_last_stage:
            merged = {k: v.double().cpu() for k, v in merge_metrics(parts).items()}
            if self.groups.dp_size > 1:
                everyone: list[Any] = [None] * self.groups.dp_size
                dist.all_gather_object(everyone, merged, group=self.groups.dp)
                merged = merge_metrics(everyone)  # same order on every rank: identical sums
            payload = [merged]
        if self.groups.pp_size > 1:
            dist.broadcast_object_list(payload, src=self.groups.last_stage_global_rank, group=self.groups.pp)
        return payload[0]

    def train_step(
        self,
        batch: ActorBatch,
        algorithm: AlgorithmConfig,
        *,
        temperature: float = 1.0,
        lopti_phase: Literal["low", "high"] | None = None,
        token_grad_norms: bool = False,
    ) -> dict[str, float]:
        """One optimizer step on the mini-batch ``batch``; returns metrics (same on every rank).

        With ``token_grad_norms``, :attr:`last_token_grad_norms` afterwards holds ``[N, L]``
        (input-aligned, every rank) the norm of each token's loss-SUM gradient w.r.t. its
        logits row, for the token-probability diagnostics (fused op's ``token_grad_norms``).

        Applies Advantage Reweighting to ``batch.advantages`` (from ``old_logp``), runs a
        STAPO entropy pre-pass when STAPO is on, then megatron's forward-backward schedule
        over padded-token-budget micro-batches with the fused vocab-parallel loss at
        ``temperature`` (use the rollout temperature, like ``old_logp``), then the step.

        Metrics (identical on every rank except the two timings, which are this rank's):
        ``loss/total`` (global ``sum(loss_sum) / sum(count)``), ``actor/grad_norm`` (global,
        before clipping), ``actor/lr`` (used by this step), ``actor/step_skipped`` (1.0 when
        the loss or grad norm was not finite), ``actor/skipped_steps_total``,
        ``actor/optimizer_steps_total``, ``actor/num_microbatches`` (summed over DP),
        ``timing_s/train_forward_backward``, ``timing_s/train_optimizer``, and the loss
        library's ``loss/*`` metrics as global means (sums of ``[sum, count]`` pairs over
        micro-batches and DP, then divided; ``loss/active_tokens`` is a global count).
        """
        batch.require_training_fields(algorithm.needs_ref_logp)
        start = time.perf_counter()
        local = batch.select(self._local_rows(batch.num_sequences))
        advantages, ar_metrics = prepare_advantages(local.advantages, local.old_logp, local.loss_mask, algorithm)
        local = replace(local, advantages=advantages)
        microbatches = make_microbatches(local, self.config.max_tokens_per_microbatch, device=_device())
        if algorithm.stapo.enabled:
            threshold = self._stapo_threshold(microbatches, algorithm, temperature, lopti_phase)
            for mb in microbatches:
                mb.stapo_threshold = threshold
        options = replace(self._vocab_options(temperature), token_grad_norms=token_grad_norms)
        norms: list[list[torch.Tensor]] = []

        def loss_func(mb: MicroBatch, logits: torch.Tensor):
            inputs = LossInputs(
                targets=mb.targets,
                old_logp=mb.old_logp,
                advantages=mb.advantages,
                mask=mb.loss_mask,
                ref_logp=mb.ref_logp,
                lopti_phase=lopti_phase,
                stapo_threshold=mb.stapo_threshold,
            )
            out, stats = fused_policy_loss(logits, inputs, algorithm, options)
            if token_grad_norms:
                norms.append([stats.logit_grad_norm.reshape(mb.targets.shape)])
            # clone: megatron may scale the returned loss in place.
            report = {"loss": torch.stack([out.loss_sum.detach().clone().double(), out.count.double()]), **out.metrics}
            return out.loss_sum, out.count.round().to(torch.int), report

        lr = float(self.optimizer.param_groups[0]["lr"])
        self.ddp.train()
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        reports = self._run_schedule(microbatches, loss_func, forward_only=False)
        fb_time = time.perf_counter() - start
        if self.groups.is_last_stage:
            count = torch.tensor([float(len(microbatches)), 1.0], dtype=torch.float64)
            reports = reports + [{"num_microbatches": count}] + ([ar_metrics] if ar_metrics else [])
        merged = self._reduce_reports(reports)
        loss_pair = merged.pop("loss")
        num_microbatches = float(merged.pop("num_microbatches")[0])
        loss = float(loss_pair[0] / loss_pair[1]) if float(loss_pair[1]) > 0 else float(loss_pair[0])

        opt_start = time.perf_counter()
        grad_norm, updated = self._optimizer_step(loss_finite=math.isfinite(loss))
        self.train_steps += 1
        metrics = {
            "loss/total": loss,
            "actor/grad_norm": grad_norm,
            "actor/lr": lr,
            "actor/step_skipped": 0.0 if updated else 1.0,
            "actor/skipped_steps_total": float(self.skipped_steps),
            "actor/optimizer_steps_total": float(self.optimizer_steps),
            "actor/num_microbatches": num_microbatches,
            "timing_s/train_forward_backward": fb_time,
            "timing_s/train_optimizer": time.perf_counter() - opt_start,
        }
        metrics.update(finalize_metrics(merged))
        if token_grad_norms:
            n, length = batch.input_ids.shape
            self.last_token_grad_norms = self._gather_token_values(
                n, length, local.num_sequences, microbatches, norms
            )[0].cpu()
        return metrics

    def _optimizer_step(self, *, loss_finite: bool) -> tuple[float, bool]:
        """Megatron's step with a non-finite guard; returns (grad norm before clipping, updated)."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        with torch.no_grad(), cpu_shim.cuda_to_cpu():
            found_inf = self.optimizer.prepare_grads()
            # Collective over the grad-stats group: identical on every rank.
            grad_norm = float(self.optimizer.get_grad_norm())
            if found_inf or not loss_finite or not math.isfinite(grad_norm):
                self.skipped_steps += 1
                return grad_norm, False
            clip = self.config.grad_clip
            if clip:
                for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                    params = opt.get_parameters()
                    if params:
                        clip_grad_by_total_norm_fp32(
                            params,
                            max_norm=clip,
                            total_norm=grad_norm,
                            use_decoupled_grad=opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8,
                        )
            self.optimizer.step_with_ready_grads()
        self.scheduler.step(increment=1)
        self.optimizer_steps += 1
        return grad_norm, True

    # ------------------------------------------------------------------ checkpoints & weights

    def save_checkpoint(self, directory: str | Path, *, trainer_state: dict | None = None) -> Path:
        """Atomically write model, optimizer, RNG and counters to ``directory`` (see
        ``actor.checkpoint``); ``directory/../latest`` then names it. Collective.

        ``trainer_state`` (JSON-serialisable: the driver's step, data cursor, ...) is stored
        in the same atomic write, so a checkpoint never exists without it; ``load_checkpoint``
        returns it under ``"trainer"``."""
        # A DP rank may hold no optimizer shard (tiny models): agree on the step count.
        step = ckpt.adam_step(self.optimizer)
        step_t = torch.tensor([-1.0 if step is None else step], dtype=torch.float64, device=_device())
        dist.all_reduce(step_t, op=dist.ReduceOp.MAX)
        state = {
            "train_steps": self.train_steps,
            "optimizer_steps": self.optimizer_steps,
            "skipped_steps": self.skipped_steps,
            "adam_step": None if float(step_t) < 0 else float(step_t),
            "scheduler": self.scheduler.state_dict(),
        }
        if trainer_state is not None:
            state["trainer"] = trainer_state
        return ckpt.save_checkpoint(
            directory,
            model=self.model,
            optimizer=self.optimizer,
            groups=self.groups,
            actor_state=state,
            hf_config=self.hf_config,
            hf_source_dir=self.hf_source_dir,
            optimizer_sharding=self.config.checkpoint_optimizer_sharding,
        )

    def load_checkpoint(self, directory: str | Path, *, load_optimizer: bool | None = None, load_rng: bool = True) -> dict:
        """Load a checkpoint written by :meth:`save_checkpoint` at any TP/PP (weights always;
        optimizer state when TP/PP match or it was saved ``fully_reshardable``, see
        ``actor.checkpoint``), or a weights-only converted checkpoint. ``directory`` may be
        the checkpoint or its parent with a ``latest`` pointer. Restores counters and the
        LR schedule when present. Collective."""
        record = ckpt.load_checkpoint(
            directory,
            model=self.model,
            optimizer=self.optimizer,
            groups=self.groups,
            load_optimizer=load_optimizer,
            load_rng=load_rng,
        )
        self.train_steps = int(record.get("train_steps", 0))
        self.optimizer_steps = int(record.get("optimizer_steps", 0))
        self.skipped_steps = int(record.get("skipped_steps", 0))
        if "scheduler" in record:
            self.scheduler.load_state_dict(record["scheduler"])
        return record

    def load_hf_weights(self, directory: str | Path) -> int:
        """Initialise the weights from a HF safetensors directory (each rank reads its own
        shards; see ``actor.weights.load_hf_weights``) and refresh the optimizer's master
        weights. Returns the number of local parameters written. Collective (barrier)."""
        written = load_hf_weights(
            self.model,
            directory,
            adapter=self.adapter,
            hf_config=self.hf_config,
            padded_vocab_size=self.padded_vocab_size,
            groups=self.groups,
            gated_linear_unit=bool(self.transformer_config.gated_linear_unit),
        )
        with torch.no_grad(), cpu_shim.cuda_to_cpu():
            self.optimizer.reload_model_params()
        dist.barrier()
        return written

    def iter_hf_weights(self, bucket_bytes: int = 512 * 2**20):
        """Yield ``(hf_name, full tensor)`` pairs covering exactly the HF state dict (see
        ``actor.weights``): TP shards gathered, all PP stages covered, vocabulary padding
        stripped; units are gathered ``bucket_bytes`` at a time. Every rank yields the same
        pairs and must consume the iterator to the end (collectives inside)."""
        return iter_hf_weights(
            self.model,
            adapter=self.adapter,
            hf_config=self.hf_config,
            padded_vocab_size=self.padded_vocab_size,
            groups=self.groups,
            gated_linear_unit=bool(self.transformer_config.gated_linear_unit),
            bucket_bytes=bucket_bytes,
        )


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _source_dir(source: Any) -> Path | None:
    """The HF model directory the config came from (for tokenizer files), if any."""
    if isinstance(source, (str, Path)):
        path = Path(source)
        return path if path.is_dir() else path.parent
    return None
