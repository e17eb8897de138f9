"""PackedDotProductAttention: both ways of attending over a pack (one padded call, or
segment by segment) against float64 causal attention of each sequence alone, forward and
gradients, with grouped-query heads; unpacked input (its SDPA path) against megatron's
own ``DotProductAttention`` on the same module, with no mask, the causal mask and a
padding mask; and which way a pack takes."""

import itertools

import pytest
import torch

from tests.dist_utils import run_on_ranks

HEADS, GROUPS, DIM = 4, 2, 8


def _reference(q, k, v, lengths):
    """Each sequence alone: causal SDPA in float64, KV groups repeated to the heads."""
    outs = []
    for qs, ks, vs in zip(q.split(lengths), k.split(lengths), v.split(lengths)):
        rep = HEADS // GROUPS
        ks, vs = ks.repeat_interleave(rep, dim=1), vs.repeat_interleave(rep, dim=1)
        o = torch.nn.functional.scaled_dot_product_attention(
            qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1), is_causal=True
        )  # [heads, n, dim]
        outs.append(o.transpose(0, 1).reshape(len(qs), HEADS * DIM))
    return torch.cat(outs)


CASES = {"similar": [5, 7, 6, 7], "skewed": [1, 30, 2], "one": [9], "short": [3, 3, 3, 3, 3, 3, 2]}
FACTORS = {"batched": 1000, "per_segment": 0}


def _check(rank, world, results):
    """Every case both ways in one process (starting megatron's process groups costs seconds)."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    import megatron_rl.models.attention as attention
    from megatron_rl.actor.compat import cpu_shim

    cpu_shim.apply()  # megatron's attention takes its score buffer from the CUDA device otherwise
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(0)  # the attention-dropout RNG megatron forks
    try:
        config = TransformerConfig(
            num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS, num_query_groups=GROUPS,
            kv_channels=DIM, attention_dropout=0.0, **cpu_shim.transformer_config_overrides(),
        )  # fmt: skip
        core = attention.PackedDotProductAttention(config, 1, AttnMaskType.causal, "self")
        for (case, lengths), (way, factor) in itertools.product(CASES.items(), FACTORS.items()):
            attention.BATCH_PADDING_FACTOR = factor
            g = torch.Generator().manual_seed(sum(lengths))
            t = sum(lengths)
            q = (torch.randn(t, HEADS, DIM, generator=g, dtype=torch.float64) * 2).requires_grad_()
            k = (torch.randn(t, GROUPS, DIM, generator=g, dtype=torch.float64) * 2).requires_grad_()
            v = torch.randn(t, GROUPS, DIM, generator=g, dtype=torch.float64).requires_grad_()
            cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
            params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
            out = core(q, k, v, None, packed_seq_params=params)
            upstream = torch.randn(out.shape, generator=g, dtype=torch.float64)
            grads = torch.autograd.grad(out, (q, k, v), upstream)
            want = _reference(q, k, v, lengths)
            want_grads = torch.autograd.grad(want, (q, k, v), upstream)
            results.append((case, way, out.detach(), want.detach(), grads, want_grads))
        # Unpacked [s, b, heads, dim]: the SDPA path against megatron's computation.
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        seq, batch = 11, 3
        g = torch.Generator().manual_seed(7)
        hidden = torch.rand(batch, 1, 1, seq, generator=g) < 0.3
        hidden[..., 0] = False  # every query sees at least one key
        masks = {"none": None, "causal": torch.ones(seq, seq, dtype=torch.bool).triu(1)[None, None], "padding": hidden}
        for name, mask in masks.items():
            q = torch.randn(seq, batch, HEADS, DIM, generator=g, dtype=torch.float64).requires_grad_()
            k = torch.randn(seq, batch, GROUPS, DIM, generator=g, dtype=torch.float64).requires_grad_()
            v = torch.randn(seq, batch, GROUPS, DIM, generator=g, dtype=torch.float64).requires_grad_()
            assert core.takes_sdpa(None)
            out = core(q, k, v, mask)
            # megatron builds its default causal mask on the CUDA device: give it explicitly.
            want = DotProductAttention.forward(core, q, k, v, masks["causal"] if mask is None else mask)
            upstream = torch.randn(out.shape, generator=g, dtype=torch.float64)
            grads = torch.autograd.grad(out, (q, k, v), upstream)
            want_grads = torch.autograd.grad(want, (q, k, v), upstream)
            results.append((f"unpacked_{name}", "sdpa", out.detach(), want.detach(), grads, want_grads))
        # Attention dropout in training is megatron's (its RNG tracker): no SDPA then.
        dropout = attention.PackedDotProductAttention(
            TransformerConfig(**{**config.__dict__, "attention_dropout": 0.1}), 1, AttnMaskType.causal, "self"
        )
        results.append(("dropout", "takes_sdpa", dropout.train().takes_sdpa(None), dropout.eval().takes_sdpa(None)))
    finally:
        parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module")
def outcomes():
    return {(case, way): rest for case, way, *rest in run_on_ranks(_check, 1)}


@pytest.mark.parametrize("mask", ["none", "causal", "padding"])
def test_unpacked_sdpa_equals_megatrons_attention(outcomes, mask):
    out, want, grads, want_grads = outcomes[f"unpacked_{mask}", "sdpa"]
    torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)
    for got, ref, name in zip(grads, want_grads, "qkv"):
        torch.testing.assert_close(got, ref, atol=1e-10, rtol=1e-10, msg=lambda m, name=name: f"d{name}: {m}")


def test_attention_dropout_in_training_stays_megatrons(outcomes):
    assert outcomes["dropout", "takes_sdpa"] == [False, True]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("way", FACTORS)
def test_both_ways_equal_each_sequence_alone(outcomes, case, way):
    out, want, grads, want_grads = outcomes[case, way]
    torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)
    for got, ref, name in zip(grads, want_grads, "qkv"):
        torch.testing.assert_close(got, ref, atol=1e-10, rtol=1e-10, msg=lambda m, name=name: f"d{name}: {m}")


@pytest.mark.parametrize(
    ("lengths", "batched"),
    [([5, 7, 6, 7], True), ([1, 30, 2], False), ([20, 14, 2], True), ([20, 14, 1], False), ([20, 1], True), ([9], True)],
)
def test_which_way_a_pack_takes(lengths, batched):
    # Batched while padding to the longest at most doubles the attention work (so two
    # segments always are: 2 * 20**2 <= 2 * (20**2 + 1)).
    from megatron_rl.models.attention import pads_into_one_call

    assert pads_into_one_call(lengths) is batched
