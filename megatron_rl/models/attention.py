"""Core attention of megatron-core's local (non-Transformer-Engine) layer spec that also
takes packed sequences.

megatron's packed-sequence path (``PackedSeqParams`` in THD layout) is made for
Transformer Engine: ``Attention`` applies RoPE per sequence from ``cu_seqlens`` and then
hands the core attention ``[t, heads, dim]`` tensors of all sequences end to end; TE's
kernels attend within each sequence. The local spec's ``DotProductAttention`` refuses
packed input. :class:`PackedDotProductAttention` is that class with packed input
accepted; the layer spec selects it (``DecoderAdapter.layer_spec``), nothing is patched.

Packed, the attention is block-diagonal causal: a token attends to the earlier tokens of
its own sequence only. It is never computed as one ``[t, t]`` mask (whose cost grows
with the square of the whole pack). Two ways, both megatron's own attention with a mask,
chosen per call by cost:

- **batched**: the segments padded to the longest, ``[longest, n_seq, heads, dim]``, in
  one call with a causal + key-padding mask, the padding rows dropped after. It costs
  ``n_seq * longest**2``; taken when that is at most twice the sum of the squared
  lengths (segments of similar length), because one call saves the per-call overhead
  that dominates short sequences (the RL case: many sequences of a few hundred tokens).
- **per segment**: each segment alone, a ``[len, 1, heads, dim]`` view, with a causal
  mask; it costs the sum of the squared lengths (what a variable-length kernel costs),
  for packs that mix a long sequence with short ones.

Either way each sequence sees exactly what it would see alone.

Every call, packed or not, computes with ``torch.nn.functional.scaled_dot_product_attention``
when megatron's attention would compute plain softmax attention: no attention dropout
in training, no attention bias, no sliding window, vanilla softmax. It is the same
function (the scores scaled by megatron's ``softmax_scale`` times the query-key layer
coefficient, the mask applied, softmax, times the values; key/value groups shared by
their heads), in one fused kernel instead of megatron's ``baddbmm``, repeated
key/value heads, masked fill, softmax and ``bmm``: on CPU 0.7-0.8x the time of a
layer's attention forward and backward (``tests/unit/test_packed_attention.py`` checks
both against float64). Anything else goes to ``DotProductAttention`` unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

__all__ = ["BATCH_PADDING_FACTOR", "PackedDotProductAttention", "pads_into_one_call"]

BATCH_PADDING_FACTOR = 2
"""Segments go through one padded call when ``n_seq * longest**2`` is at most this many
times the sum of their squared lengths (the attention work done for padding)."""


def pads_into_one_call(lengths: list[int]) -> bool:
    """Whether segments of these lengths are attended in one padded call (else one by one)."""
    return len(lengths) * max(lengths) ** 2 <= BATCH_PADDING_FACTOR * sum(n * n for n in lengths)


class PackedDotProductAttention(DotProductAttention):
    """``DotProductAttention`` that also attends over packed sequences (THD, ``cu_seqlens``)."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type=None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        """Unpacked: ``[s, b, heads, dim]`` in, ``[s, b, heads * dim]`` out (megatron's).
        Packed (``packed_seq_params.qkv_format == 'thd'``): ``[t, heads, dim]`` in (query
        heads for ``query``, KV groups for ``key``/``value``), ``[t, heads * dim]`` out;
        ``attention_mask`` is not used (the mask is causal within each segment)."""
        if packed_seq_params is None:
            if self.takes_sdpa(attention_bias) and (attention_mask is None or attention_mask.dtype == torch.bool):
                return self._sdpa(query, key, value, attention_mask)
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"packed sequences must be in THD layout, got {packed_seq_params.qkv_format!r}")
        cu = packed_seq_params.cu_seqlens_q
        if not torch.equal(cu.cpu(), packed_seq_params.cu_seqlens_kv.cpu()):
            raise ValueError("self-attention over packed sequences needs cu_seqlens_q == cu_seqlens_kv")
        lengths = (cu[1:] - cu[:-1]).tolist()
        longest = max(lengths)
        causal = torch.ones(longest, longest, dtype=torch.bool, device=query.device).triu(diagonal=1)
        if pads_into_one_call(lengths):
            return self._batched(query, key, value, lengths, causal, attn_mask_type, attention_bias)
        outputs = []
        for q, k, v in zip(*(t.split(lengths) for t in (query, key, value))):
            n = q.shape[0]
            mask = causal[:n, :n][None, None]
            context = self.forward(q[:, None], k[:, None], v[:, None], mask, attn_mask_type, attention_bias)
            outputs.append(context[:, 0])  # [n, 1, heads * dim] -> [n, heads * dim]
        return torch.cat(outputs)

    def _batched(self, query, key, value, lengths, causal, attn_mask_type, attention_bias) -> torch.Tensor:
        """Every segment in one call: ``[t, heads, dim]`` -> ``[longest, n_seq, heads, dim]``
        (zero padding), a mask hiding future and padding keys, then the ``t`` real rows
        back end to end (``[t, heads * dim]``). Gathers by index, so no host sync."""
        n_seq, longest, device = len(lengths), causal.shape[0], query.device
        length_t = torch.tensor(lengths, device=device)
        segment = torch.repeat_interleave(torch.arange(n_seq, device=device), length_t)  # [t]
        starts = torch.cumsum(length_t, 0) - length_t
        position = torch.arange(query.shape[0], device=device) - starts[segment]  # [t]
        slot = position * n_seq + segment  # row of [longest * n_seq] (megatron's [s, b] order)

        def pad(t: torch.Tensor) -> torch.Tensor:
            out = t.new_zeros(longest * n_seq, *t.shape[1:]).index_copy(0, slot, t)
            return out.view(longest, n_seq, *t.shape[1:])

        padding_key = torch.arange(longest, device=device)[None, :] >= length_t[:, None]  # [n_seq, longest]
        mask = causal[None, None] | padding_key[:, None, None, :]  # [n_seq, 1, longest, longest], True = hidden
        context = self.forward(pad(query), pad(key), pad(value), mask, attn_mask_type, attention_bias)
        return context.reshape(longest * n_seq, -1).index_select(0, slot)

    def takes_sdpa(self, attention_bias: torch.Tensor | None) -> bool:
        """Whether megatron's attention would be plain softmax attention, which SDPA computes."""
        dropout = self.attention_dropout.p if self.training else 0.0
        return (
            attention_bias is None
            and dropout == 0.0
            and self.softmax_offset is None
            and self.scale_mask_softmax.window_size is None
        )

    def _sdpa(self, query, key, value, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """``[sq, b, heads, dim]`` query, ``[sk, b, groups, dim]`` key/value -> ``[sq, b, heads * dim]``.

        ``attention_mask`` is megatron's (``True`` = hidden, broadcast to ``[b, heads, sq,
        sk]``); without one, megatron's causal mask type hides the future (for more than
        one query: one query with a cache sees every key), any other type nothing."""
        scale = self.softmax_scale
        if self.config.apply_query_key_layer_scaling:  # megatron divides it out, then multiplies in the softmax
            scale *= self.layer_number
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads or groups, s, dim]
        gqa = q.shape[1] != k.shape[1]
        if attention_mask is not None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask, scale=scale, enable_gqa=gqa)
        else:
            causal = self.attn_mask_type == AttnMaskType.causal and q.shape[2] > 1
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)
