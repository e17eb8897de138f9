"""An RMSNorm for megatron-core's local (non-Transformer-Engine) layer spec that works with
sequence parallelism.

megatron-core's local spec builds its norms with ``WrappedTorchNorm``, which refuses
``sequence_parallel`` (without TE or Apex there is no norm that marks its weight for the
tensor-parallel gradient reduction). With sequence parallelism each TP rank normalises a
different slice of the sequence, so the norm weight's gradient is a partial sum per
rank: this module marks its weight ``sequence_parallel`` so that megatron's
``finalize_model_grads`` all-reduces it over the TP group, exactly as TE's norms do.
The math is ``torch.nn.functional.rms_norm``, the kernel ``torch.nn.RMSNorm`` (the local
spec's norm) uses, so results equal the local spec's to the bit.
"""

from __future__ import annotations

import torch

__all__ = ["SequenceParallelRMSNorm"]


class SequenceParallelRMSNorm(torch.nn.Module):
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dimension (megatron norm signature)."""

    def __init__(
        self,
        config,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,  # megatron's norm signature; unused here
        zero_centered_gamma: bool = False,
        normalization: str = "RMSNorm",
    ):
        super().__init__()
        if config.normalization != "RMSNorm" or zero_centered_gamma or config.layernorm_zero_centered_gamma:
            raise ValueError("SequenceParallelRMSNorm implements plain RMSNorm only")
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        # finalize_model_grads all-reduces the grads of params marked so, over the TP group.
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
