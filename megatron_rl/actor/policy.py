"""One pipeline stage of a GPT policy on this rank and its forward pass: the model built
from the spec, megatron's schedule, and per-token log-probs.

Shared by the trained actor (``actor.py``: DDP, optimizer, train step) and the frozen
reference policy (``reference.py``). The last stage turns its output into per-token
log-probs and losses with the fused vocab-parallel op (``megatron_rl.ops``) in one of
two ways (``actor.loss_impl``):

- ``fused_linear`` (default): the final hidden states (``hidden.py``) and this rank's
  output-layer shard go to the op, which multiplies chunk by chunk; the
  ``[tokens, V/TP]`` logits never exist. The op runs in megatron's ``[s, b]`` layout, so
  per-token inputs are transposed to it and results back.
- ``logits``: megatron's output layer materialises the vocab-parallel logits ``[b, s, V/TP]``.

Both give the same values (float32: within 1e-6; the tests check losses, gradients and
updated weights). Micro-batches are packed (``trainer.pack_sequences``: whole sequences
end to end, megatron's ``PackedSeqParams`` in THD layout; Transformer Engine's attention
on GPUs, ``models.attention.PackedDotProductAttention`` in the local spec) or padded,
and padded at the end to the sequence multiple the kernels need (:func:`pad_multiple`).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl.actor.batch import ActorBatch, MicroBatch, filler_microbatch, make_microbatches, resolve_packing
from megatron_rl.actor.collectives import device, gather_token_values
from megatron_rl.actor.compat import cpu_shim
from megatron_rl.actor.hidden import final_hidden_states, output_weight
from megatron_rl.actor.launch import ProcessGroups, initialize_parallel_from
from megatron_rl.actor.model import (
    build_gpt_model,
    build_transformer_config,
    frozen_fp8_scaling,
    load_hf_config,
    resolve_use_te,
)
from megatron_rl.actor.router_losses import RouterLossMeter
from megatron_rl.actor.routing_replay import RoutingReplay
from megatron_rl.actor.spec import ActorSpec
from megatron_rl.actor.weights import HFWeightSource, gather_adapters, iter_hf_weights, load_hf_weights
from megatron_rl.algo import AlgorithmConfig, LossOutput
from megatron_rl.models import adapter_for_config, padded_vocab_size
from megatron_rl.ops import (
    LossInputs,
    SoftmaxStats,
    VocabParallelOptions,
    fused_linear_policy_loss,
    fused_policy_loss,
    vocab_parallel_logprobs,
    vocab_parallel_logprobs_from_hidden,
)
from megatron_rl.ops.vocab_parallel import resolve_kernel

__all__ = ["LogProbs", "PolicyModel", "check_loss_kernel", "pad_multiple"]

_TOKEN_FIELDS = ("targets", "old_logp", "advantages", "mask", "ref_logp", "engine_logp")


def check_loss_kernel(kernel: str, on: torch.device, dtype: torch.dtype) -> None:
    """``actor.loss_kernel`` can run for logits of ``dtype`` on device ``on``, checked when
    the actor starts rather than at its first loss (``ConfigError`` naming the field)."""
    from megatron_rl.config.lib import ConfigError

    try:
        resolve_kernel(kernel, torch.empty(0, device=on, dtype=dtype))
    except ValueError as e:
        raise ConfigError("actor.loss_kernel", str(e)) from None


@dataclass(kw_only=True)
class LogProbs:
    """Per-token results of :meth:`PolicyModel.compute_logprobs`, aligned with ``input_ids``."""

    logp: torch.Tensor
    """``[N, L]`` float32 ``log p(input_ids[:, t] | input_ids[:, :t])`` at the temperature; 0 at
    column 0 and on padding."""
    entropy: torch.Tensor
    """``[N, L]`` float32 entropy of the next-token distribution that predicted token ``t``."""
    routing_agreement: float | None = None
    """With routing replay and a batch's ``routed_experts``: the share of the engine's
    (token, layer, k) expert choices this policy's own routers made too (over the world);
    else ``None``."""


def pad_multiple(spec: ActorSpec, *, use_te: bool) -> int:
    """The multiple each micro-batch's sequence length is padded to: ``actor.pad_tokens_to_multiple_of``,
    or what the kernels need: with FP8, megatron-core's alignment of the recipe's GEMMs
    (``fp8_utils.get_fp8_align_size``: 32 for ``mxfp8``, whose scales cover blocks of 32,
    16 for the others); 16 for Transformer Engine without FP8; the TP size with sequence
    parallelism (the sequence is split over TP)."""
    if spec.actor.pad_tokens_to_multiple_of is not None:
        multiple = spec.actor.pad_tokens_to_multiple_of
    elif spec.model.fp8 is not None:
        from megatron.core.enums import Fp8Recipe
        from megatron.core.fp8_utils import get_fp8_align_size

        multiple = get_fp8_align_size(Fp8Recipe(spec.model.fp8_recipe))
    else:
        multiple = 16 if use_te else 1
    if spec.parallel.sequence_parallel:
        multiple = math.lcm(multiple, spec.parallel.tensor_model_parallel_size)
    return multiple


class PolicyModel:
    """This rank's stage of a policy; construct on every rank of an initialised process group."""

    freezes_fp8_scaling = True
    """Forward-only passes leave delayed FP8 scaling as it was (``actor.model.frozen_fp8_scaling``):
    a trained policy's scales follow its training forwards only."""

    def __init__(self, spec: ActorSpec, *, groups: ProcessGroups | None = None):
        self.spec = spec
        self.hf_source_dir = _source_dir(spec.architecture)
        self.hf_config = load_hf_config(spec.architecture)
        self.adapter = adapter_for_config(self.hf_config)
        tp, pp = spec.parallel.tensor_model_parallel_size, spec.parallel.pipeline_model_parallel_size
        self.groups = groups or initialize_parallel_from(spec.parallel, seed=spec.trainer.seed)
        ep, etp = spec.parallel.expert_model_parallel_size, spec.parallel.resolved_expert_tensor_parallel_size
        g = self.groups
        if (g.tp_size, g.pp_size, g.ep_size, g.etp_size) != (tp, pp, ep, etp):
            raise ValueError(f"groups are TP={g.tp_size} PP={g.pp_size} EP={g.ep_size} ETP={g.etp_size}; "
                             f"spec says TP={tp} PP={pp} EP={ep} ETP={etp}")  # fmt: skip
        self.vocab_size = int(self.hf_config["vocab_size"])
        self.padded_vocab_size = padded_vocab_size(
            self.vocab_size, tp_size=tp, divisible_by=spec.model.make_vocab_size_divisible_by
        )
        self.transformer_config = build_transformer_config(
            self.hf_config, parallel=spec.parallel, options=spec.model, actor=spec.actor
        )
        check_loss_kernel(spec.actor.loss_kernel, device(), self.transformer_config.params_dtype)
        self.model = build_gpt_model(
            self.hf_config,
            self.transformer_config,
            pre_process=self.groups.is_first_stage,
            post_process=self.groups.is_last_stage,
            options=spec.model,
            adapter=self.adapter,
            lora=spec.lora,
        )
        self.fused_linear = spec.actor.loss_impl == "fused_linear"
        self.use_te = resolve_use_te(spec.model, lora=spec.lora is not None)
        self.pad_multiple = pad_multiple(spec, use_te=self.use_te)
        self.router_losses: RouterLossMeter | None = None
        """A trained mixture-of-experts policy's router auxiliary losses (set by the actor)."""
        self.routing_replay: RoutingReplay | None = None
        """Set by :meth:`enable_routing_replay`: batches' ``routed_experts`` route the MoE layers."""

    def enable_routing_replay(self) -> None:
        """Route this policy's MoE layers by a batch's ``routed_experts`` from now on, in
        log-prob and training forwards (``actor/routing_replay.py``); a batch without them
        routes as before."""
        if not self.transformer_config.num_moe_experts:
            raise ValueError("routing replay needs a mixture-of-experts model; this one is dense")
        self.routing_replay = RoutingReplay(
            [self.model], self.transformer_config, tp_rank=self.groups.tp_rank, tp_size=self.groups.tp_size
        )

    # ------------------------------------------------------------------ forward machinery

    @property
    def model_chunks(self) -> list:
        """What megatron's schedule runs (the actor wraps its model in DDP)."""
        return [self.model]

    def _local_rows(self, n: int) -> torch.Tensor:
        if n < self.groups.dp_size:
            raise ValueError(f"batch of {n} sequences is smaller than the data-parallel size {self.groups.dp_size}")
        return torch.arange(self.groups.dp_rank, n, self.groups.dp_size)

    def _local_batch(self, batch: ActorBatch) -> ActorBatch:
        """This data-parallel rank's rows of ``batch``; its engine routes checked on the
        whole batch (every rank refuses alike, before any collective) and dropped without
        routing replay."""
        if batch.routed_experts is not None:
            if self.routing_replay is None:
                batch = replace(batch, routed_experts=None)
            else:
                self.routing_replay.check(batch.routed_experts)
        return batch.select(self._local_rows(batch.num_sequences))

    def _microbatches(self, batch: ActorBatch) -> list[MicroBatch]:
        budget = self.spec.trainer.max_tokens_per_microbatch
        lengths = batch.lengths.tolist()
        pack = resolve_packing(self.spec.trainer.pack_sequences, lengths, budget, self.pad_multiple, use_te=self.use_te)
        microbatches = make_microbatches(batch, budget, device=device(), pad_to_multiple_of=self.pad_multiple, pack=pack)
        if self.groups.ep_size * self.groups.etp_size > self.groups.tp_size:
            # Each MoE layer's all-to-all (over the expert TP x EP ranks) then spans DP ranks,
            # so they must run as many forwards: the ranks with fewer micro-batches run
            # fillers that train on nothing.
            count = torch.tensor([len(microbatches)], dtype=torch.int64, device=device())
            dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.groups.dp)
            microbatches += [filler_microbatch(microbatches[0], self.pad_multiple)
                             for _ in range(int(count) - len(microbatches))]  # fmt: skip
        return microbatches

    def _vocab_options(self, temperature: float) -> VocabParallelOptions:
        return VocabParallelOptions(
            temperature=temperature,
            tp_group=self.groups.tp if self.groups.tp_size > 1 else None,
            vocab_size=self.vocab_size,
            chunk_tokens=self.spec.actor.logits_chunk_tokens,
            kernel=self.spec.actor.loss_kernel,
        )

    def _run_schedule(self, microbatches: list[MicroBatch], loss_func, *, forward_only: bool) -> list:
        """megatron's forward(-backward) schedule over ``microbatches``; ``loss_func(mb, output)``
        gets the last stage's output (final hidden states ``[s, b, H]`` with the fused lm-head,
        else logits ``[b, s, V/TP]``); returns its reports (last stage; ``[]`` elsewhere)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        hidden_only = self.fused_linear and self.groups.is_last_stage

        # The CPU shim's mode is for megatron's schedule code ("cuda" literals); the model's
        # forward and the loss run outside it (cpu_shim.suspended).
        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            packed = _packed_seq_params(mb)
            mask = None if packed else self._attention_mask(mb.input_ids.shape[1], mb.input_ids.device)
            inputs = dict(attention_mask=mask, packed_seq_params=packed)
            record = replay = contextlib.nullcontext()
            if self.router_losses is not None and not forward_only:
                record = self.router_losses.recording(filler=not len(mb.rows))
            if self.routing_replay is not None:
                replay = self.routing_replay.replaying(mb.routed_experts, training=not forward_only)
            with cpu_shim.suspended(mode), record, replay:
                if hidden_only:
                    output = final_hidden_states(self.model, mb.input_ids, mb.position_ids(), **inputs)
                else:  # labels=None: the last stage returns vocab-parallel logits [b, s, V/TP]
                    output = model(mb.input_ids, mb.position_ids(), **inputs)
            return output, partial(outside_mode_loss, mb)

        def outside_mode_loss(mb: MicroBatch, output: torch.Tensor):
            with cpu_shim.suspended(mode):
                return loss_func(mb, output)

        if self.routing_replay is not None:
            self.routing_replay.begin()
        with cpu_shim.cuda_to_cpu() as mode:
            return get_forward_backward_func(pp_size=self.groups.pp_size)(
                forward_step_func=forward_step,
                data_iterator=iter(microbatches),
                model=self.model_chunks,
                num_microbatches=len(microbatches),
                seq_length=max(mb.input_ids.shape[1] for mb in microbatches),
                micro_batch_size=max(mb.input_ids.shape[0] for mb in microbatches),
                forward_only=forward_only,
            )

    def _attention_mask(self, s: int, device: torch.device) -> torch.Tensor | None:
        """The causal mask the local spec's attention applies (``True`` = masked), given
        explicitly: megatron builds a default one on ``"cuda"``, which fails on CPU when an
        activation recompute re-runs attention in the backward pass. Transformer Engine's
        fused attention takes none (causal by its mask type)."""
        if self.use_te:
            return None
        return torch.ones(s, s, dtype=torch.bool, device=device).triu(diagonal=1)[None, None]

    def token_logprobs(
        self, mb: MicroBatch, output: torch.Tensor, options: VocabParallelOptions
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward-only ``(logp, entropy)`` ``[b, s]`` of one micro-batch from the last stage's output."""
        if not self.fused_linear:
            return vocab_parallel_logprobs(output, mb.targets, mask=mb.target_mask, options=options)
        logp, entropy = vocab_parallel_logprobs_from_hidden(
            output, output_weight(self.model), mb.targets.t(), mask=mb.target_mask.t(), options=options
        )
        return logp.t(), entropy.t()

    def token_loss(
        self,
        mb: MicroBatch,
        output: torch.Tensor,
        inputs: LossInputs,
        algorithm: AlgorithmConfig,
        options: VocabParallelOptions,
    ) -> tuple[LossOutput, SoftmaxStats, torch.Tensor | None]:
        """The fused policy loss of one micro-batch (``inputs`` in ``[b, s]``); returns the
        loss output, the softmax stats and, when asked for, the ``[b, s]`` per-token
        logit-gradient norms.

        With the fused lm-head, the output-layer gradient is accumulated straight into
        its ``main_grad`` (megatron DDP's grad buffer, reduced and divided by the global
        count in ``finalize_model_grads``) during forward."""
        # Sequence ids keep seq-mean aggregation per sequence: a pack's segments (padded
        # [b, s] rows are sequences by themselves).
        seq_index = mb.segment_ids() if mb.packed else None
        if not self.fused_linear:
            out, stats = fused_policy_loss(output, replace(inputs, seq_index=seq_index), algorithm, options)
            norms = self.token_values(mb, stats.logit_grad_norm) if options.token_grad_norms else None
            return out, stats, norms
        b, s = mb.targets.shape
        if seq_index is None:  # the op works in megatron's [s, b] layout: name the rows
            seq_index = torch.arange(b, device=mb.targets.device)[:, None].expand(b, s)
        transposed = {name: getattr(inputs, name).t() for name in _TOKEN_FIELDS if getattr(inputs, name) is not None}
        inputs_sb = replace(inputs, **transposed, seq_index=seq_index.t())
        weight = output_weight(self.model)
        main_grad = getattr(weight, "main_grad", None) if torch.is_grad_enabled() else None
        out, stats = fused_linear_policy_loss(output, weight, inputs_sb, algorithm, options, weight_main_grad=main_grad)
        norms = self.token_values(mb, stats.logit_grad_norm) if options.token_grad_norms else None
        return out, stats, norms

    def token_values(self, mb: MicroBatch, values: torch.Tensor) -> torch.Tensor:
        """One value per token of the loss's flat ``[T]`` (``SoftmaxStats``: log-probs,
        norms) as ``[b, s]``: the fused lm-head works in megatron's ``[s, b]`` order."""
        b, s = mb.targets.shape
        return values.reshape(s, b).t() if self.fused_linear else values.reshape(b, s)

    def _forward_logprobs(self, microbatches: list[MicroBatch], temperature: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Forward-only log-probs and entropies per micro-batch, target-aligned ``[b, s]``
        (last stage; ``[]`` elsewhere)."""
        options = self._vocab_options(temperature)

        def loss_func(mb: MicroBatch, output: torch.Tensor):
            logp, entropy = self.token_logprobs(mb, output, options)
            zero = torch.zeros((), dtype=torch.float32, device=output.device)
            return zero, torch.zeros((), dtype=torch.int), {"logp": logp, "entropy": entropy}

        for chunk in self.model_chunks:
            chunk.eval()
        frozen = frozen_fp8_scaling(self.model_chunks, options=self.spec.model) if self.freezes_fp8_scaling else (
            contextlib.nullcontext())  # fmt: skip
        with torch.no_grad(), frozen:
            reports = self._run_schedule(microbatches, loss_func, forward_only=True)
        return [(r["logp"], r["entropy"]) for r in reports]

    # ------------------------------------------------------------------ log-probs

    def compute_logprobs(self, batch: ActorBatch, temperature: float | None = None) -> LogProbs:
        """Per-token log-probs and entropies of ``batch`` under the current weights (no grad).

        ``logp[i, t] = log softmax(logits[i, t - 1] / T)[input_ids[i, t]]`` for every real
        token ``t >= 1`` (0 at column 0 and on padding), ``T`` the spec's (rollout)
        temperature unless given; ``entropy`` is the full next-token distribution's entropy
        at the same temperature, same alignment.

        Returned on EVERY rank: the last pipeline stage computes its DP shard, the shards
        are all-gathered over DP and the result broadcast from the last stage over PP
        (TP ranks compute identical values). Collective over the world.
        """
        temperature = self.spec.temperature if temperature is None else temperature
        n, length = batch.input_ids.shape
        local = self._local_batch(batch)
        microbatches = self._microbatches(local)
        results = self._forward_logprobs(microbatches, temperature)
        values = [[lp, h] for lp, h in results]
        full = gather_token_values(self.groups, n, length, local.num_sequences, microbatches, values)
        return LogProbs(logp=full[0].cpu(), entropy=full[1].cpu(), routing_agreement=self.routing_agreement())

    def routing_agreement(self) -> float | None:
        """The share of engine expert choices the routers also made in the forwards since
        the last call, over the world (collective when replay is on); ``None`` without
        replay or without engine choices."""
        if self.routing_replay is None:
            return None
        agreed, compared = self.routing_replay.agreement(dist.group.WORLD)
        return agreed / compared if compared else None

    # ------------------------------------------------------------------ weights

    def load_hf_weights(self, directory: str | Path) -> int:
        """Copy the weights of a HF safetensors directory into this stage's shards (each rank
        reads its own; see ``actor.weights.load_hf_weights``); the number written."""
        return load_hf_weights(
            self.model,
            directory,
            adapter=self.adapter,
            hf_config=self.hf_config,
            padded_vocab_size=self.padded_vocab_size,
            groups=self.groups,
            gated_linear_unit=bool(self.transformer_config.gated_linear_unit),
        )

    def weight_source(self, *, dtype: torch.dtype, every_rank: bool = False) -> HFWeightSource:
        """The HF-named weights in ``dtype`` as a weight-transfer source (``actor.weights``):
        full tensors on global rank 0 only, or on ``every_rank``. A LoRA policy's adapted
        weights are merged, or with ``rollout.lora_sync: adapter`` the base weights alone
        (the engines take the adapters from :meth:`adapter_update`)."""
        return HFWeightSource(
            self.model,
            dtype=dtype,
            every_rank=every_rank,
            merge_adapters=self.spec.rollout.lora_sync == "merged",
            adapter=self.adapter,
            hf_config=self.hf_config,
            padded_vocab_size=self.padded_vocab_size,
            groups=self.groups,
            gated_linear_unit=bool(self.transformer_config.gated_linear_unit),
        )

    def adapter_update(self):
        """The adapters as PEFT tensors on global rank 0 (``weight_sync.adapters.AdapterUpdate``),
        ``None`` elsewhere; collective on every rank (``actor.weights.gather_adapters``)."""
        if self.spec.lora is None:
            raise RuntimeError("adapter_update(): this policy has no LoRA adapters (actor.lora)")
        return gather_adapters(
            self.model,
            lora=self.spec.lora,
            adapter=self.adapter,
            hf_config=self.hf_config,
            padded_vocab_size=self.padded_vocab_size,
            groups=self.groups,
            gated_linear_unit=bool(self.transformer_config.gated_linear_unit),
        )

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


def _packed_seq_params(mb: MicroBatch):
    """megatron's ``PackedSeqParams`` (THD) of a packed micro-batch; ``None`` when padded."""
    if not mb.packed:
        return None
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = mb.cu_seqlens.to(mb.input_ids.device)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=mb.max_seqlen,
                           max_seqlen_kv=mb.max_seqlen)  # fmt: skip


def _source_dir(source: Any) -> Path | None:
    """The HF model directory the config came from (for tokenizer files), if any."""
    if isinstance(source, (str, Path)):
        path = Path(source)
        return path if path.is_dir() else path.parent
    return None
