"""The Megatron actor: one process per rank, TP/PP/DP training with the fused policy loss.

``MegatronActor`` is the trained policy: one pipeline stage's ``GPTModel`` shard
(``policy.py``: model build, forward schedule, log-probs, the fused lm-head or logits
path) wrapped in megatron DDP, the megatron optimizer (DistributedOptimizer by default;
``actor/optimizer.py``) and its LR scheduler. It is built from an
:class:`~megatron_rl.actor.spec.ActorSpec` (the run's sections by reference), so the loss
configuration and the temperature are fixed at construction. Its methods are
collective: every rank of the world calls them with the SAME full batch (each Ray actor
rank receives a copy). Each DP rank takes the rows ``dp_rank::dp_size`` of it; TP and PP
ranks of a replica work on the same rows.

Per-token alignment, padding and micro-batching: see ``megatron_rl.actor.batch``. One
RL step's update (phases x epochs x mini-batches) is ``actor/update.py``; this class
runs one optimizer step on one mini-batch. The frozen reference policy is
``actor/reference.py``.

Loss normalisation (megatron's ``calculate_per_token_loss`` contract): the loss function
of a micro-batch returns ``(loss_sum, count, report)`` from the fused vocab-parallel op;
megatron DDP SUMS gradients over DP and ``finalize_model_grads`` divides them by the
global count (summed over micro-batches, broadcast from the last stage over PP,
all-reduced over DP). The gradient is therefore that of ``sum(loss) / sum(count)`` over
the whole mini-batch, independent of the micro-batch and DP split (``count`` follows
``algorithm.aggregation``: valid tokens for ``token_mean``, sequences for the seq-mean
modes, ...). The reported loss is the same ratio computed from the reports.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl.actor.batch import ActorBatch, MicroBatch
from megatron_rl.actor.checkpoint import save_load as ckpt
from megatron_rl.actor.collectives import device, gather_token_values, reduce_reports
from megatron_rl.actor.compat import cpu_shim
from megatron_rl.actor.launch import ProcessGroups
from megatron_rl.actor.optimizer import adam_step, build_optimizer, optimizer_step, set_adam_kernel
from megatron_rl.actor.policy import LogProbs, PolicyModel
from megatron_rl.actor.router_losses import RouterLossMeter
from megatron_rl.actor.spec import ActorSpec
from megatron_rl.algo import (
    AlgorithmConfig,
    PrepassTokens,
    finalize_metrics,
    needs_prepass,
    prepare_advantages,
    prepass_statistics,
)
from megatron_rl.algo.sft import SFT_OBJECTIVE, SFTObjective
from megatron_rl.ops import LossInputs
from megatron_rl.storage.checkpoints import BASE_WEIGHTS_KEY, base_reference

__all__ = ["LogProbs", "MegatronActor"]


class MegatronActor(PolicyModel):
    """One rank of the trained policy. Construct on every rank of an initialised process group."""

    def __init__(self, spec: ActorSpec, *, groups: ProcessGroups | None = None):
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )

        super().__init__(spec, groups=groups)
        self.algorithm = spec.algorithm
        """The loss configuration (``spec.algorithm``; ``train_step(algorithm=...)`` overrides it once)."""
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=spec.actor.use_distributed_optimizer,
        )
        with cpu_shim.cuda_to_cpu():
            self.ddp = DistributedDataParallel(config=self.transformer_config, ddp_config=ddp_config, module=self.model)
        # The schedules read these from the model config: no grad sync until the last
        # micro-batch, then DP reduction, embedding-grad sync and the division by the
        # global token count.
        self.transformer_config.no_sync_func = self.ddp.no_sync
        self.transformer_config.finalize_model_grads_func = finalize_model_grads
        self.optimizer, self.scheduler = build_optimizer(
            self.ddp,
            spec.trainer,
            params_dtype=spec.model.torch_dtype,
            use_distributed_optimizer=spec.actor.use_distributed_optimizer,
            lr_decay_steps=spec.lr_decay_steps,
            kernel=spec.actor.optimizer_kernel,
        )
        if self.transformer_config.num_moe_experts:
            self.router_losses = RouterLossMeter(self.model_chunks, self.transformer_config, self.groups)
        if spec.rollout.routing_replay:
            self.enable_routing_replay()
        self.train_steps = 0
        """``train_step`` calls so far (skipped ones included)."""
        self.optimizer_steps = 0
        """Successful optimizer updates so far."""
        self.skipped_steps = 0
        """Updates skipped for a non-finite loss or gradient norm."""
        self.last_token_grad_norms: torch.Tensor | None = None
        """``[N, L]`` per-token logit-gradient norms of the last ``train_step(token_grad_norms=True)``."""
        self.last_train_logp: torch.Tensor | None = None
        """``[N, L]`` old (= current) log-probs of the last ``train_step(on_policy=True)``."""
        self._train_state_offloaded = False
        self.base_weights: dict[str, str] | None = None
        """A LoRA actor's frozen base weights, when loaded from a file (``{"path", "fingerprint"}``):
        its checkpoints then hold the adapters only and name these. None: the base is in no file
        (random init, or it came from a checkpoint that holds it), so checkpoints hold it too."""

    @property
    def model_chunks(self) -> list:
        return [self.ddp]

    # ------------------------------------------------------------------ training

    def _prepass(self, microbatches: list[MicroBatch], algorithm: AlgorithmConfig, phase: str | None) -> dict:
        """Mini-batch statistics the loss needs (``algo.prepass_statistics``) from a
        forward-only pass: the weights do not change within the optimizer step, so its
        ``p`` and ``H`` equal the loss's. Gathered over the DP group; last stage only."""
        results = self._forward_logprobs(microbatches, self.spec.temperature)
        if not self.groups.is_last_stage:
            return {}
        # An on-policy step has no old_logp yet: the pre-pass runs the old policy's weights.
        parts = [
            PrepassTokens(logp=logp, entropy=entropy, old_logp=logp if mb.old_logp is None else mb.old_logp,
                          advantages=mb.advantages, mask=mb.loss_mask)
            for mb, (logp, entropy) in zip(microbatches, results)
        ]  # fmt: skip
        return prepass_statistics(algorithm, phase, parts, group=self.groups.dp)

    def train_step(
        self,
        batch: ActorBatch,
        *,
        phase: str | None = None,
        token_grad_norms: bool = False,
        algorithm: AlgorithmConfig | SFTObjective | None = None,
        on_policy: bool = False,
        tis_cap: float | None = None,
    ) -> dict[str, float]:
        """One optimizer step on the mini-batch ``batch``; returns metrics (same on every rank).

        ``phase`` is the update phase (``algo.update_phases``; ``None`` without phases);
        ``algorithm`` overrides the spec's loss for this step (tests compare methods on one
        model; ``algo.sft.SFT_OBJECTIVE`` trains on the response tokens' likelihood at
        temperature 1, reading only ``loss_mask``: :meth:`sft_step`). With
        ``token_grad_norms``, :attr:`last_token_grad_norms` afterwards holds ``[N, L]`` (input-aligned, every rank) the norm of each token's loss-SUM gradient
        w.r.t. its logits row, for the token-probability diagnostics.

        ``on_policy``: the weights are still the old policy's (no optimizer step since the
        rollout's weights), so ``batch.old_logp`` is ignored and the old log-probs are this
        forward's own, detached (ratio exactly 1); :attr:`last_train_logp` afterwards holds
        them, ``[N, L]`` input-aligned on every rank (response tokens; 0 elsewhere). Refused
        when a method reads the old log-probs before the forward (``old_logp_before_forward``).
        ``tis_cap`` (on-policy only, with ``batch.engine_logp``): the truncated importance
        weights of those log-probs against the engines' multiply the advantages inside the
        loss, as ``update_policy`` multiplies them before the update when the old log-probs
        are recomputed; refused with a pre-pass, which reads the advantages first.

        Applies the methods' advantage reweighting to ``batch.advantages`` (from
        ``old_logp``), runs the pre-pass when a method needs one, then megatron's
        forward-backward schedule over token-budget micro-batches (packed or padded) with the fused
        vocab-parallel loss at the spec's temperature (like ``old_logp``), then the step.

        Metrics (identical on every rank except the two timings, which are this rank's):
        ``loss/total`` (global ``sum(loss_sum) / sum(count)``, plus ``loss/moe_aux`` of a
        mixture-of-experts model, whose ``moe/*`` router losses are reported too:
        ``actor/router_losses.py``), ``actor/grad_norm`` (global,
        before clipping), ``actor/lr`` (used by this step), ``actor/step_skipped`` (1.0 when
        the loss or grad norm was not finite), ``actor/skipped_steps_total``,
        ``actor/optimizer_steps_total``, ``actor/num_microbatches`` (summed over DP),
        ``actor/padding_fraction`` (padding tokens / tokens run, over micro-batches and DP),
        ``actor/packed_fraction`` (packed micro-batches / all, over DP; ``pack_sequences: auto``),
        ``timing_s/train_forward_backward``, ``timing_s/train_optimizer``, and the loss
        library's ``loss/*`` metrics as global means (sums of ``[sum, count]`` pairs over
        micro-batches and DP, then divided; ``loss/active_tokens`` is a global count).
        """
        if self._train_state_offloaded:
            raise RuntimeError("train_step while the train state is offloaded: call onload_train_state() first")
        algorithm = algorithm or self.algorithm
        sft = isinstance(algorithm, SFTObjective)
        if sft and (phase is not None or on_policy or tis_cap is not None):
            raise ValueError("the SFT objective has no phase, old policy or importance weights")
        batch.require_training_fields(algorithm.needs_ref_logp, need_old=not (on_policy or sft), need_advantages=not sft)
        start = time.perf_counter()
        local = self._local_batch(batch)
        if on_policy or sft:
            local = replace(local, old_logp=None)
        if tis_cap is not None and not (on_policy and local.engine_logp is not None and not needs_prepass(algorithm)):
            raise ValueError("train_step(tis_cap=...) needs on_policy, batch.engine_logp and a loss without a pre-pass")
        reweight_metrics = {}
        if sft:
            local = replace(local, advantages=None, ref_logp=None, engine_logp=None)
        else:
            advantages, reweight_metrics = prepare_advantages(local.advantages, local.old_logp, local.loss_mask, algorithm)
            local = replace(local, advantages=advantages)
        microbatches = self._microbatches(local)
        prepass = self._prepass(microbatches, algorithm, phase) if not sft and needs_prepass(algorithm) else None
        temperature = 1.0 if sft else self.spec.temperature  # SFT fits the data's distribution itself
        options = replace(self._vocab_options(temperature), token_grad_norms=token_grad_norms)
        norms: list[list[torch.Tensor]] = []
        train_logp: list[list[torch.Tensor]] = []

        def loss_func(mb: MicroBatch, output: torch.Tensor):
            inputs = LossInputs(
                targets=mb.targets,
                old_logp=mb.old_logp,
                advantages=mb.advantages,
                mask=mb.loss_mask,
                ref_logp=mb.ref_logp,
                phase=phase,
                prepass=prepass,
                engine_logp=mb.engine_logp if tis_cap is not None else None,
                tis_cap=tis_cap,
            )
            out, stats, token_norms = self.token_loss(mb, output, inputs, algorithm, options)
            if token_norms is not None:
                norms.append([token_norms])
            if on_policy:
                logp = self.token_values(mb, stats.logp).detach()
                train_logp.append([torch.where(mb.loss_mask.bool(), logp, torch.zeros_like(logp))])
            # clone: megatron may scale the returned loss in place.
            report = {"loss": torch.stack([out.loss_sum.detach().clone().double(), out.count.double()]), **out.metrics}
            return out.loss_sum, out.count.round().to(torch.int), report

        lr = float(self.optimizer.param_groups[0]["lr"])
        self.ddp.train()
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        if self.router_losses is not None:
            self.router_losses.reset()
        reports = self._run_schedule(microbatches, loss_func, forward_only=False)
        fb_time = time.perf_counter() - start
        if self.groups.is_last_stage:
            count = torch.tensor([float(len(microbatches)), 1.0], dtype=torch.float64)
            tokens = sum(mb.num_tokens_padded for mb in microbatches)
            padding = torch.tensor([tokens - sum(mb.num_real_tokens for mb in microbatches), tokens], dtype=torch.float64)
            packed = torch.tensor([float(sum(mb.packed for mb in microbatches)), float(len(microbatches))],
                                  dtype=torch.float64)  # fmt: skip
            shape = {"num_microbatches": count, "actor/padding_fraction": padding, "actor/packed_fraction": packed}
            reports = reports + [shape] + ([reweight_metrics] if reweight_metrics else [])
        merged = reduce_reports(self.groups, reports)
        loss_pair = merged.pop("loss")
        num_microbatches = float(merged.pop("num_microbatches")[0])
        loss = float(loss_pair[0] / loss_pair[1]) if float(loss_pair[1]) > 0 else float(loss_pair[0])
        router_metrics = {} if self.router_losses is None else self.router_losses.metrics(float(loss_pair[1]))
        loss += router_metrics.get("loss/moe_aux", 0.0)

        opt_start = time.perf_counter()
        grad_norm, updated = optimizer_step(
            self.optimizer, self.scheduler, grad_clip=self.spec.trainer.grad_clip, loss_finite=math.isfinite(loss)
        )
        self.train_steps += 1
        if updated:
            self.optimizer_steps += 1
        else:
            self.skipped_steps += 1
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
        metrics.update(router_metrics)
        agreement = self.routing_agreement()
        if agreement is not None:
            metrics["moe/routing_agreement"] = agreement
        n, length = batch.input_ids.shape
        if token_grad_norms:
            self.last_token_grad_norms = gather_token_values(
                self.groups, n, length, local.num_sequences, microbatches, norms
            )[0].cpu()
        if on_policy:
            self.last_train_logp = gather_token_values(
                self.groups, n, length, local.num_sequences, microbatches, train_logp
            )[0].cpu()
        return metrics

    def sft_step(self, batch: ActorBatch) -> dict[str, float]:
        """One supervised optimizer step on ``batch`` (``input_ids``, ``attention_mask`` and
        ``loss_mask`` over the response tokens): the mean negative log-likelihood of every
        masked token of the batch (``algo.sft``), through the same fused lm-head loss,
        micro-batching, packing and optimizer as :meth:`train_step`, whose metrics it
        returns (``loss/total`` = ``loss/nll``, nats per token)."""
        return self.train_step(batch, algorithm=SFT_OBJECTIVE)

    # ------------------------------------------------------------------ time-sharing (colocated engines)

    @property
    def train_state_offloaded(self) -> bool:
        return self._train_state_offloaded

    def offload_train_state(self) -> None:
        """Free what only the update needs while colocated engines generate: the gradient
        buffers (released; megatron's ``offload_grad_buffers``) and, on GPUs, the optimizer
        state and its main parameters (moved to host memory). The model weights stay: the
        log-prob pass and the weight sync read them. A no-op when already offloaded."""
        if self._train_state_offloaded:
            return
        cuda = torch.cuda.is_available()
        self.ddp.offload_grad_buffers(synchronize=cuda, empty_cache=cuda)
        if cuda:  # on CPU the optimizer state is in host memory already
            self.optimizer.offload_to_cpu()
        self._train_state_offloaded = True

    def onload_train_state(self) -> None:
        """Undo :meth:`offload_train_state` before an update (gradient buffers come back zeroed)."""
        if not self._train_state_offloaded:
            return
        cuda = torch.cuda.is_available()
        self.ddp.restore_grad_buffers(synchronize=cuda)
        if cuda:
            self.optimizer.restore_from_cpu()
        self._train_state_offloaded = False

    # ------------------------------------------------------------------ checkpoints & weights

    def save_checkpoint(self, directory: str | Path, *, trainer_state: dict | None = None) -> Path:
        """Atomically write model, optimizer, RNG and counters to ``directory`` (see
        ``actor.checkpoint``); ``directory/../latest`` then names it. Collective.

        ``trainer_state`` (JSON-serialisable: the driver's step, data cursor, ...) is stored
        in the same atomic write, so a checkpoint never exists without it; ``load_checkpoint``
        returns it under ``"trainer"``."""
        # A DP rank may hold no optimizer shard (tiny models): agree on the step count.
        step = adam_step(self.optimizer)
        step_t = torch.tensor([-1.0 if step is None else step], dtype=torch.float64, device=device())
        dist.all_reduce(step_t, op=dist.ReduceOp.MAX)
        state = {
            "train_steps": self.train_steps,
            "optimizer_steps": self.optimizer_steps,
            "skipped_steps": self.skipped_steps,
            "adam_step": None if float(step_t) < 0 else float(step_t),
            "scheduler": self.scheduler.state_dict(),
            # what the adapters are (a LoRA checkpoint loads only into a model with them)
            "lora": None if self.spec.lora is None else {
                "rank": self.spec.lora.rank, "alpha": self.spec.lora.alpha,
                "target_modules": list(self.spec.lora.target_modules),
            },
        }  # fmt: skip
        if trainer_state is not None:
            state["trainer"] = trainer_state
        if self.base_weights is not None:
            state[BASE_WEIGHTS_KEY] = self.base_weights
        return ckpt.save_checkpoint(
            directory,
            model=self.model,
            optimizer=self.optimizer,
            groups=self.groups,
            actor_state=state,
            hf_config=self.hf_config,
            hf_source_dir=self.hf_source_dir,
            optimizer_sharding=self.spec.actor.checkpoint_optimizer_sharding,
            adapters_only=self.base_weights is not None,
        )

    def load_checkpoint(
        self, directory: str | Path, *, load_optimizer: bool | None = None, weights_only: bool = False
    ) -> dict:
        """Load a checkpoint written by :meth:`save_checkpoint` at any TP/PP (weights always;
        optimizer state when TP/PP match or it was saved ``fully_reshardable``, see
        ``actor.checkpoint``), or a weights-only converted checkpoint. ``directory`` may be
        the checkpoint or its parent with a ``latest`` pointer (``load_optimizer``: as
        ``actor.checkpoint.load_checkpoint``'s). Restores counters, the LR schedule and the
        RNG states when present, unless ``weights_only`` (a run's initial weights,
        ``model.checkpoint``: its optimizer state and settings are the run's own). Collective."""
        record = ckpt.load_checkpoint(
            directory,
            model=self.model,
            optimizer=self.optimizer,
            groups=self.groups,
            load_optimizer=False if weights_only else load_optimizer,
            load_rng=not weights_only,
            base=self.base_weights,
        )
        if record["loaded_as_base"]:  # a model without adapters: this LoRA actor's base
            self.base_weights = base_reference(ckpt.resolve_checkpoint_dir(directory))
        if weights_only:  # (the load refreshed the optimizer's master weights)
            return record
        set_adam_kernel(self.optimizer, self.spec.actor.optimizer_kernel)  # the load restored the saved groups' options
        self.train_steps = int(record.get("train_steps", 0))
        self.optimizer_steps = int(record.get("optimizer_steps", 0))
        self.skipped_steps = int(record.get("skipped_steps", 0))
        if "scheduler" in record:
            self.scheduler.load_state_dict(record["scheduler"])
        return record

    def load_hf_weights(self, directory: str | Path) -> int:
        """Initialise the weights from a HF safetensors directory (each rank reads its own
        shards) and refresh the optimizer's master weights. Returns the number of local
        parameters written. Collective (barrier)."""
        written = super().load_hf_weights(directory)
        if self.spec.lora is not None:
            self.base_weights = base_reference(directory)
        with torch.no_grad(), cpu_shim.cuda_to_cpu():
            self.optimizer.reload_model_params()
        dist.barrier()
        return written
