"""The frozen reference policy of the KL term: weights only, optionally kept in host memory
(with LoRA: the actor with its adapters off, :class:`AdaptersOffReference`).

A ``ReferencePolicy`` is one pipeline stage of the policy (``policy.py``) with nothing a
frozen model does not need: no DDP wrapper, no gradient buffer, no optimizer, and
parameters that do not require grad; its log-probs use the same fused op (forward only)
as the actor's. It always holds the run's INITIAL weights, from the same source as the
actor's (:meth:`~megatron_rl.actor.worker.ActorWorker.load_initial_weights`: a HF
directory or a Megatron checkpoint; for a random init, a copy of the actor's initial
weights, which the seed rebuilds identically on resume), and never a trained checkpoint.

With ``actor.reference_offload`` its weights stay in host memory (pinned, on CUDA)
between passes and are copied to the device only for :meth:`compute_logprobs`, so at
14B it costs no resident device memory outside that pass.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from megatron_rl.actor.batch import ActorBatch
from megatron_rl.actor.checkpoint import save_load as ckpt
from megatron_rl.actor.launch import ProcessGroups
from megatron_rl.actor.policy import LogProbs, PolicyModel
from megatron_rl.actor.spec import ActorSpec

__all__ = ["AdaptersOffReference", "ReferencePolicy"]


class ReferencePolicy(PolicyModel):
    """This rank's stage of the frozen reference policy."""

    freezes_fp8_scaling = False
    """The reference never trains: its forward-only passes are what calibrate its delayed
    FP8 scales (frozen, they would stay at their initial value)."""

    def __init__(self, spec: ActorSpec, *, groups: ProcessGroups | None = None):
        super().__init__(spec, groups=groups)
        self.model.requires_grad_(False)
        self.model.eval()
        self._host: list[torch.Tensor] | None = None  # the weights while offloaded (host memory)

    @property
    def offloaded(self) -> bool:
        """Whether the weights are in host memory now (none on the device)."""
        return self._host is not None and all(p.numel() == 0 for p in self.model.parameters())

    def resident_parameter_bytes(self) -> int:
        """Bytes the parameters hold where the model runs (0 while offloaded)."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def offload(self) -> None:
        """Move the weights to host memory (kept there; the device copy is released)."""
        params = list(self.model.parameters())
        if self._host is None:
            self._host = [_host_copy(p.data) for p in params]
        for p in params:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def onload(self) -> None:
        """Bring the weights back from host memory (a no-op when they are on the device)."""
        if self._host is None:
            return
        for p, host in zip(self.model.parameters(), self._host):
            if p.numel() == 0:
                p.data = host.to(p.device, non_blocking=True) if host.device != p.device else host
        if torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()

    @contextmanager
    def on_device(self) -> Iterator[None]:
        """The weights on the device inside the block; back in host memory after it when
        ``actor.reference_offload`` is set."""
        self.onload()
        try:
            yield
        finally:
            if self.spec.actor.reference_offload:
                self.offload()

    def _after_weights_changed(self) -> None:
        self._host = None  # the host copy is stale; the next offload copies again
        if self.spec.actor.reference_offload:
            self.offload()

    def compute_logprobs(self, batch: ActorBatch, temperature: float | None = None) -> LogProbs:
        with self.on_device():
            return super().compute_logprobs(batch, temperature)

    def copy_weights_from(self, other: PolicyModel) -> None:
        """The weights of ``other``, a policy of the same architecture and layout (this rank's shards)."""
        self.onload()
        with torch.no_grad():
            for mine, theirs in zip(self.model.parameters(), other.model.parameters(), strict=True):
                mine.copy_(theirs)
        self._after_weights_changed()

    def load_hf_weights(self, directory: str | Path) -> int:
        self.onload()
        written = super().load_hf_weights(directory)
        self._after_weights_changed()
        return written

    def load_weights_checkpoint(self, directory: str | Path) -> None:
        """The model weights of a Megatron checkpoint (at any TP/PP; nothing else). Collective."""
        self.onload()
        ckpt.load_checkpoint(directory, model=self.model, optimizer=None, groups=self.groups, load_optimizer=False,
                             load_rng=False)  # fmt: skip
        self._after_weights_changed()


class AdaptersOffReference:
    """The reference policy of a LoRA actor (``actor.lora``): the actor itself with its
    adapters switched off (``models.lora.adapters_off``). Its base weights are frozen from
    the start, so that is exactly the run's initial policy, and it costs no memory: no
    second copy of the weights, resident or offloaded."""

    def __init__(self, actor: PolicyModel):
        self.actor = actor

    def compute_logprobs(self, batch: ActorBatch, temperature: float | None = None) -> LogProbs:
        from megatron_rl.models.lora import adapters_off

        with adapters_off(self.actor.model_chunks):
            return self.actor.compute_logprobs(batch, temperature)


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of ``tensor`` (pinned memory from a CUDA tensor); the tensor itself on CPU."""
    if tensor.device.type == "cpu":
        return tensor  # already host memory: releasing the parameter's reference moves it
    host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
    return host.copy_(tensor)
