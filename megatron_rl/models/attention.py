"""Core attention of megatron-core's local (non-Transformer-Engine) layer spec that also
takes packed sequences.

megatron's packed-sequence path (``PackedSeqParams`` in THD layout) is made for
Transformer Engine: ``Attention`` applies RoPE per sequence from ``cu_seqlens`` and then
hands the core attention ``[t, heads, dim]`` tensors of all sequences end to end; TE's
kernels attend within each sequence. The local spec's ``DotProductAttention`` refuses
packed input. :class:`PackedDotProductAttention` is that class with packed input
accepted; the layer spec selects it (``DecoderAdapter.layer_spec``), nothing is patched.

Packed, the attention is block-diagonal causal: a token attends to the earlier tokens of
its own sequence only. It is computed block by block, never as one ``[t, t]`` mask (whose
cost grows with the square of the whole pack): megatron's own attention runs on each
segment of the pack alone, a ``[len, 1, heads, dim]`` view of it, with a causal mask,
and the outputs are laid back end to end. So each sequence sees exactly what it would
see alone, and the attention costs the sum of the squared sequence lengths (what a
variable-length kernel costs), not the square of the pack's nor that of its longest
sequence times the sequence count. Unpacked input goes to ``DotProductAttention``
unchanged, so results equal the local spec's.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention

__all__ = ["PackedDotProductAttention"]


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
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"packed sequences must be in THD layout, got {packed_seq_params.qkv_format!r}")
        cu = packed_seq_params.cu_seqlens_q
        if not torch.equal(cu.cpu(), packed_seq_params.cu_seqlens_kv.cpu()):
            raise ValueError("self-attention over packed sequences needs cu_seqlens_q == cu_seqlens_kv")
        lengths = (cu[1:] - cu[:-1]).tolist()
        longest = max(lengths)
        causal = torch.ones(longest, longest, dtype=torch.bool, device=query.device).triu(diagonal=1)
        outputs = []
        for q, k, v in zip(*(t.split(lengths) for t in (query, key, value))):
            n = q.shape[0]
            mask = causal[:n, :n][None, None]
            context = super().forward(q[:, None], k[:, None], v[:, None], mask, attn_mask_type, attention_bias)
            outputs.append(context[:, 0])  # [n, 1, heads * dim] -> [n, heads * dim]
        return torch.cat(outputs)
