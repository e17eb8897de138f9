"""The actor's end of a weight sync: the sender of a transfer group.

Runs inside every actor rank (``actor.worker.ActorWorker``). Every rank iterates the same
:class:`~megatron_rl.actor.weights.WeightSource` in lockstep (its TP/PP gathers are
collectives); rank 0 alone sends. Which sender depends on the transfer backend only:

- ``gloo``: :class:`~megatron_rl.weight_sync.transports.gloo.GlooSender` (host memory; CPU
  machines, and any engine that takes host tensors);
- ``nccl`` / ``ipc``: vLLM's own trainer engines (``weight_sync.transports.vllm``);
- ``shm``: :class:`SharedMemorySender` (``rollout.weight_transport: shared_memory``):
  rank 0 writes the version into a host shared-memory file
  (:mod:`~megatron_rl.weight_sync.transports.shm`) and returns its descriptor, which the pool
  hands to the engines in place of an object-store bucket.

All are driven the same way: opened once per transfer group (the first two join the
pool's ``EngineGroupClient``), then ``send_weights()`` once per version.
"""

from __future__ import annotations

from typing import Any

from megatron_rl.weight_sync.meta import WeightSource
from megatron_rl.weight_sync.transports.gloo import GlooInitInfo, GlooSender
from megatron_rl.weight_sync.transports.shm import SharedBucket, SharedWeightsWriter

__all__ = ["SharedMemorySender", "open_sender"]


class SharedMemorySender:
    """The ``shm`` backend's sender: rank 0 owns the shared file (created here, laid out
    by the source's metadata); every rank iterates the source in lockstep."""

    def __init__(self, source: WeightSource, *, is_writer: bool):
        self.source = source
        self.writer = SharedWeightsWriter(source.metadata()) if is_writer else None

    def send_weights(self) -> SharedBucket | None:
        """Write the current weights; rank 0 returns the file's descriptor, others ``None``."""
        if self.writer is None:
            for _ in self.source:  # the TP/PP gathers are collectives
                pass
            return None
        return self.writer.write(self.source)

    def shutdown(self) -> None:
        if self.writer is not None:
            self.writer.close()


def open_sender(
    source: WeightSource, *, rank: int, backend: str, client: Any, init: dict[str, Any], bucket_bytes: int = 512 << 20
) -> Any:
    """The sender of ``backend`` over ``source`` for this rank, joined to the engines'
    transfer group (rank 0 hosts the rendezvous; other ranks only keep the source).

    vLLM's ``nccl`` and ``ipc`` senders run packed, with ``bucket_bytes`` buffers
    (``rollout.weight_sync_bucket_mb``): ``nccl`` double-buffers (two buffers on rank 0 and
    on every receiving worker), ``ipc`` reuses one buffer on each rank (at least the largest
    tensor: vLLM refuses a tensor that does not fit, and a 14B model's embedding is 1.5 GiB
    in bf16), so a sync's peak is
    the buffers plus the tensor being gathered, not a model copy (vLLM's unpacked IPC mode
    would keep every tensor of the model alive until the send ends)."""
    if backend == "gloo":
        return GlooSender.trainer_init(GlooInitInfo(**init), client=client, source=source, is_sender=rank == 0)
    if backend == "shm":
        return SharedMemorySender(source, is_writer=rank == 0)
    if backend in ("nccl", "ipc"):
        from megatron_rl.weight_sync.transports.vllm import open_sender as open_vllm_sender

        buffer_bytes = int(bucket_bytes)
        if backend == "ipc":  # one fixed buffer, which vLLM refuses a tensor larger than
            buffer_bytes = max(buffer_bytes, max((m.num_bytes for m in source.metadata()), default=0))
        fields: dict[str, Any] = {"packed": True, "packed_buffer_size_bytes": buffer_bytes}
        if backend == "nccl":
            fields.update({k: init[k] for k in ("master_address", "master_port", "world_size")})
        return open_vllm_sender(backend, client=client, source=source, rank=rank, **fields)
    raise ValueError(f"weight-transfer backend {backend!r}: expected gloo, nccl, ipc or shm")
