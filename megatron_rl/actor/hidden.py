"""The last pipeline stage's final hidden states and output weight, by composition of
megatron's ``GPTModel``, for the fused lm-head loss (``actor.loss_impl: fused_linear``).

``GPTModel.forward`` ends in its output layer, which materialises the ``[s, b, V/TP]``
logits. The fused lm-head path needs what goes into that layer instead: the decoder's
output after the final norm. :func:`final_hidden_states` runs the model's own
preprocessing (embedding on the first stage, rotary embeddings) and its decoder, which
applies the final norm on the last stage; nothing of megatron is patched. With sequence
parallelism the decoder's output is sharded along the sequence over the TP group and is
gathered here, as megatron's output layer gathers its input.
"""

from __future__ import annotations

import torch

__all__ = ["final_hidden_states", "output_weight"]


def final_hidden_states(
    gpt,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    packed_seq_params=None,
) -> torch.Tensor:
    """``[s, b, H]`` hidden states after the final norm, the full sequence on every TP rank.

    ``gpt`` is one stage's ``GPTModel`` (the last stage: ``post_process=True``); on a
    later pipeline stage its decoder reads the input the schedule set with
    ``set_input_tensor``. ``packed_seq_params``: megatron's ``PackedSeqParams`` of packed
    sequences (``s`` is then the pack, ``b`` 1). Differentiable: with sequence parallelism the gather's backward
    takes this rank's sequence slice of the (TP-summed) gradient.
    """
    from megatron.core import tensor_parallel

    pre = gpt._preprocess(input_ids=input_ids, position_ids=position_ids, packed_seq_params=packed_seq_params)
    decoder_input, rotary_pos_emb, rotary_pos_cos, rotary_pos_sin, sequence_len_offset = pre[:5]
    hidden = gpt.decoder(
        hidden_states=decoder_input,
        attention_mask=attention_mask,
        rotary_pos_emb=rotary_pos_emb,
        rotary_pos_cos=rotary_pos_cos,
        rotary_pos_sin=rotary_pos_sin,
        sequence_len_offset=sequence_len_offset,
        packed_seq_params=packed_seq_params,
    )
    if gpt.config.sequence_parallel:
        # The fused op sums the hidden-state gradient over the TP group itself, so the
        # gather's backward only splits (tensor_parallel_output_grad=False), never reduces.
        hidden = tensor_parallel.gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
    return hidden


def output_weight(gpt) -> torch.Tensor:
    """This rank's ``[V/TP, H]`` output-layer shard (the tied embedding when they are shared)."""
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight
