"""Single-process pieces of the actor: batch validation and alignment, micro-batch planning,
TP shard split/join, config plumbing. (The multi-rank behaviour is in test_actor.py.)"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.actor.batch import (
    AUTO_PACK_PADDING_FRACTION,
    ActorBatch,
    make_microbatches,
    padding_fraction,
    plan_microbatches,
    plan_packs,
    resolve_packing,
)
from megatron_rl.actor.weights import concat_tp_shards, take_tp_shard
from megatron_rl.config.model import ModelOptions


def _batch(lengths, L=8, prompt=2) -> ActorBatch:
    n = len(lengths)
    ids = torch.arange(n * L).reshape(n, L) % 50
    attn = (torch.arange(L)[None] < torch.tensor(lengths)[:, None]).long()
    loss_mask = attn.clone()
    loss_mask[:, :prompt] = 0
    values = torch.arange(n * L, dtype=torch.float32).reshape(n, L)
    return ActorBatch(input_ids=ids, attention_mask=attn, loss_mask=loss_mask, old_logp=-values, advantages=values)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=30), st.integers(1, 120))
def test_plan_respects_the_padded_budget(lengths, budget):
    plan = plan_microbatches(lengths, budget)
    assert sorted(i for mb in plan for i in mb) == list(range(len(lengths)))
    for mb in plan:
        cost = len(mb) * max(lengths[i] for i in mb)
        assert cost <= budget or len(mb) == 1  # an over-long sequence gets a micro-batch of its own
    assert plan == plan_microbatches(lengths, budget)  # deterministic


def test_microbatches_are_target_aligned():
    batch = _batch([8, 5, 3])
    mbs = make_microbatches(batch, max_tokens=12)
    assert [mb.rows.tolist() for mb in mbs] == [[0], [1, 2]]
    mb = mbs[1]
    assert mb.input_ids.shape == (2, 5)  # trimmed to its longest row
    # Column t of the micro-batch is the prediction of input token t + 1.
    assert torch.equal(mb.targets[:, :-1], batch.input_ids[1:, 1:5])
    assert torch.equal(mb.advantages[:, :-1], batch.advantages[1:, 1:5])
    assert torch.equal(mb.old_logp[:, :-1], batch.old_logp[1:, 1:5])
    assert mb.loss_mask[:, -1].sum() == 0 and mb.target_mask[:, -1].sum() == 0
    # Row 2 has 3 tokens: predictions exist for targets 1 and 2 only.
    assert mb.target_mask[1].tolist() == [True, True, False, False, False]
    assert mb.loss_mask[1].tolist() == [0, 1, 0, 0, 0]  # input token 2 is the only response token


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=30), st.integers(1, 120))
def test_packs_respect_the_real_token_budget(lengths, budget):
    plan = plan_packs(lengths, budget)
    assert sorted(i for pack in plan for i in pack) == list(range(len(lengths)))
    for pack in plan:
        assert sum(lengths[i] for i in pack) <= budget or len(pack) == 1
    # First-fit decreasing: no later pack's first sequence would have fitted an earlier pack.
    for k, pack in enumerate(plan):
        for earlier in plan[:k]:
            assert sum(lengths[i] for i in earlier) + lengths[pack[0]] > budget
    assert plan == plan_packs(lengths, budget)  # deterministic


def test_packed_microbatches_shift_each_sequence_on_its_own():
    batch = _batch([8, 5, 3])
    (mb,) = make_microbatches(batch, max_tokens=16, pack=True, pad_to_multiple_of=4)
    assert mb.rows.tolist() == [0, 1, 2] and mb.input_ids.shape == (1, 16)
    assert mb.cu_seqlens.tolist() == [0, 8, 13, 16] and mb.max_seqlen == 8
    assert mb.num_real_tokens == 16 and mb.padding_fraction == 0.0
    ends = [7, 12, 15]  # each sequence's last token predicts nothing (no target from the next sequence)
    assert not mb.target_mask[0, ends].any() and not mb.loss_mask[0, ends].any()
    for row, (start, n) in enumerate([(0, 8), (8, 5), (13, 3)]):
        assert torch.equal(mb.input_ids[0, start : start + n], batch.input_ids[row, :n])
        assert torch.equal(mb.targets[0, start : start + n - 1], batch.input_ids[row, 1:n])
        assert torch.equal(mb.advantages[0, start : start + n - 1], batch.advantages[row, 1:n])
        assert torch.equal(mb.loss_mask[0, start : start + n - 1], batch.loss_mask[row, 1:n])
        assert mb.position_ids()[0, start : start + n].tolist() == list(range(n))
        assert (mb.segment_ids()[0, start : start + n] == row).all()
    # Per-row values come back in the padded [b, s] alignment, zeros past each sequence.
    padded = make_microbatches(batch, max_tokens=100)[0]
    assert torch.equal(mb.per_row(mb.target_mask), padded.target_mask)
    keep = padded.target_mask
    assert torch.equal(mb.per_row(mb.advantages) * keep, padded.advantages * keep)


def test_packs_pad_their_end_as_a_segment_of_its_own():
    batch = _batch([8, 5, 3])
    mbs = make_microbatches(batch, max_tokens=9, pack=True, pad_to_multiple_of=4)
    assert [mb.rows.tolist() for mb in mbs] == [[0], [1, 2]]
    mb = mbs[1]
    assert mb.cu_seqlens.tolist() == [0, 5, 8] and mb.input_ids.shape == (1, 8)  # 8 real tokens, no tail
    mb = make_microbatches(_batch([8, 5, 2]), max_tokens=9, pack=True, pad_to_multiple_of=4)[1]
    assert mb.cu_seqlens.tolist() == [0, 5, 7, 8] and mb.padding_fraction == 1 / 8
    assert mb.position_ids()[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 0]
    assert not mb.target_mask[0, 6:].any() and not mb.loss_mask[0, 6:].any()


def test_routed_experts_stay_input_aligned_in_padded_packed_and_filler_microbatches():
    from dataclasses import replace

    from megatron_rl.actor.batch import NO_ROUTE, filler_microbatch

    batch = _batch([8, 5, 3])
    routes = torch.arange(3 * 8 * 2 * 2).reshape(3, 8, 2, 2)  # [N, L, M=2 layers, k=2]
    routes[batch.attention_mask == 0] = NO_ROUTE
    batch = replace(batch, routed_experts=routes)
    padded = make_microbatches(batch, max_tokens=12)[1]  # rows 1, 2 trimmed to 5 positions
    assert padded.routed_experts.shape == (2, 5, 2, 2)
    assert torch.equal(padded.routed_experts, routes[1:, :5])  # NOT shifted: about the input token
    wide = make_microbatches(batch, max_tokens=16, pad_to_multiple_of=16)[0]  # padded past the batch's width
    assert wide.routed_experts.shape == (1, 16, 2, 2) and (wide.routed_experts[:, 8:] == NO_ROUTE).all()
    packed = make_microbatches(batch, max_tokens=9, pack=True, pad_to_multiple_of=3)[1]  # rows 1, 2 + 1 pad
    assert packed.routed_experts.shape == (1, 9, 2, 2)
    assert torch.equal(packed.routed_experts[0, :8], torch.cat([routes[1, :5], routes[2, :3]]))
    assert (packed.routed_experts[0, 8] == NO_ROUTE).all()
    filler = filler_microbatch(packed, 4)
    assert filler.routed_experts.shape == (1, 4, 2, 2) and (filler.routed_experts == NO_ROUTE).all()
    assert torch.equal(batch.select([2]).routed_experts, routes[2:])
    with pytest.raises(ValueError, match="routed_experts"):
        replace(batch, routed_experts=routes[:, :5])


def test_padding_fraction_and_the_auto_packing_decision():
    # Equal lengths: no padding, whatever the budget; auto pads (the local spec's packed
    # attention costs more per token) unless Transformer Engine runs.
    assert padding_fraction([41] * 32, 4096) == 0.0
    assert not resolve_packing("auto", [41] * 32, 4096, use_te=False)
    assert resolve_packing("auto", [41] * 32, 4096, use_te=True)
    # The padded plan groups similar lengths: [8, 7] then [2, 1] with a budget of 16 tokens.
    assert padding_fraction([8, 7, 2, 1], 16) == pytest.approx(1 - 18 / (2 * 8 + 2 * 2))
    # Rounding to a multiple counts as padding too: 3 tokens in 4.
    assert padding_fraction([3], 100, pad_to_multiple_of=4) == pytest.approx(0.25)
    ragged = [60, 5, 33, 7, 250, 12]  # one micro-batch padded to 250: 75% padding
    assert padding_fraction(ragged, 4096) == pytest.approx(1 - sum(ragged) / (6 * 250))
    assert resolve_packing("auto", ragged, 4096, use_te=False)
    # Just over and just under the threshold (one micro-batch of two rows).
    over = AUTO_PACK_PADDING_FRACTION + 0.01
    assert resolve_packing("auto", [100, round(100 * (1 - 2 * over))], 4096, use_te=False)
    assert not resolve_packing("auto", [100, 100 - 38], 4096, use_te=False)  # 19% padding
    # Explicit settings win over the lengths.
    assert resolve_packing(True, [41] * 4, 4096, use_te=False) and not resolve_packing(False, ragged, 4096, use_te=True)


def test_batch_validation():
    ids = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="right-padded"):
        ActorBatch(input_ids=ids, attention_mask=torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]]))
    with pytest.raises(ValueError, match=r"loss_mask\[:, 0\]"):
        ActorBatch(input_ids=ids, attention_mask=torch.ones(2, 4), loss_mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match="padding"):
        ActorBatch(input_ids=ids, attention_mask=torch.tensor([[1, 1, 0, 0]] * 2), loss_mask=torch.tensor([[0, 1, 1, 0]] * 2))
    with pytest.raises(ValueError, match="position_ids"):
        ActorBatch(input_ids=ids, attention_mask=torch.ones(2, 4), position_ids=torch.zeros(2, 4))
    with pytest.raises(ValueError, match="shape"):
        ActorBatch(input_ids=ids, attention_mask=torch.ones(2, 3))
    with pytest.raises(ValueError, match="loss_mask"):
        ActorBatch(input_ids=ids, attention_mask=torch.ones(2, 4)).require_training_fields(need_ref=False)


@pytest.mark.parametrize(
    "name,dim",
    [
        ("decoder.layers.0.mlp.linear_fc1.weight", 0),
        ("decoder.layers.0.self_attention.linear_proj.weight", 1),
        ("output_layer.weight", 0),
    ],
)
def test_tp_split_and_join_are_inverse(name, dim):
    full = torch.randn(8, 6)
    param = torch.nn.Parameter(torch.empty(1))
    param.tensor_model_parallel, param.partition_dim = True, dim
    shards = [take_tp_shard(name, full, param, tp_rank=r, tp_size=2, gated_linear_unit=True) for r in range(2)]
    assert torch.equal(concat_tp_shards(name, shards, dim=dim, gated_linear_unit=True), full)
    if "linear_fc1" in name:  # each rank holds [gate_r; up_r]
        gate, up = full.chunk(2)
        assert torch.equal(shards[1], torch.cat([gate[2:], up[2:]]))


def test_actor_spec_from_run_config():
    # The actor reads the run's sections by reference (no copied settings); derived values
    # (the run's optimizer-step count for the LR decay) are properties of the spec.
    from megatron_rl.algo import AlgorithmConfig, LoptiConfig
    from megatron_rl.config.parallel import ParallelConfig
    from megatron_rl.config.run import RunConfig
    from megatron_rl.config.trainer import TrainerConfig
    from megatron_rl.loop.builder import actor_spec

    run = RunConfig(
        parallel=ParallelConfig(num_actor_ranks=4, tensor_model_parallel_size=2),
        trainer=TrainerConfig(num_steps=10, num_minibatches_per_step=2, lr=3e-6, lr_schedule="cosine"),
        algorithm=AlgorithmConfig(lopti=LoptiConfig(enabled=True)),
    )
    cfg = actor_spec(run)
    assert cfg.parallel.tensor_model_parallel_size == 2 and cfg.parallel.pipeline_model_parallel_size == 1
    assert cfg.trainer.lr == 3e-6 and cfg.trainer.lr_schedule == "cosine"
    assert cfg.lr_decay_steps == 10 * 2 * 2  # Lopti doubles the optimizer steps
    assert cfg.architecture["model_type"] == run.model.tiny.model_type
    assert cfg.parallel is run.parallel and cfg.trainer is run.trainer and cfg.model is run.model
    with pytest.raises(ValueError, match="fp8"):
        ModelOptions(fp8="e4m3", use_te=False)


def test_fp8_recompute_and_sequence_parallel_reach_the_transformer_config():
    from megatron_rl.actor.model import resolve_use_te, transformer_config_kwargs
    from megatron_rl.config.lib import ConfigError
    from megatron_rl.config.parallel import ParallelConfig
    from megatron_rl.config.trainer import ActorConfig

    hf = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100}  # fmt: skip
    options = ModelOptions(dtype="bfloat16", fp8="hybrid", fp8_recipe="delayed", fp8_margin=1, fp8_amax_history_len=16)
    kwargs = transformer_config_kwargs(
        hf, parallel=ParallelConfig(num_actor_ranks=2, tensor_model_parallel_size=2, sequence_parallel=True),
        options=options, actor=ActorConfig(recompute_granularity="full", recompute_num_layers=2), use_te=True,
    )  # fmt: skip
    assert (kwargs["fp8"], kwargs["fp8_recipe"], kwargs["fp8_margin"], kwargs["fp8_amax_history_len"]) == (
        "hybrid", "delayed", 1, 16,
    )  # fmt: skip
    assert kwargs["sequence_parallel"] is True and kwargs["tensor_model_parallel_size"] == 2
    assert (kwargs["recompute_granularity"], kwargs["recompute_method"], kwargs["recompute_num_layers"]) == (
        "full", "uniform", 2,
    )  # fmt: skip
    # Without Transformer Engine, FP8 or use_te is a config error naming the field.
    with pytest.raises(ConfigError, match="model.fp8"):
        resolve_use_te(options, available=False)
    with pytest.raises(ConfigError, match="model.use_te"):
        resolve_use_te(ModelOptions(use_te=True), available=False)
    assert resolve_use_te(options, available=True) is True
