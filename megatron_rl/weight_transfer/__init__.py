"""Weights from the actor into the rollout engines: the one sync path and its transports.

Every sync is one weight *version*: the whole model as HF-named full tensors
(:class:`~megatron_rl.weight_transfer.meta.TensorMeta`), checked by every engine before
anything moves (:func:`~megatron_rl.weight_transfer.meta.check_update`), then streamed
by a transport, then committed (the engines report the new version). Transports differ
by name only (``rollout.weight_transport``):

- ``object_store``: rank 0's buckets through Ray's object store (``megatron_rl.weight_buckets``);
- ``shared_memory``: rank 0 writes a host shared-memory file that engines on its node map
  and load like a bucket (:mod:`.shm`);
- ``collective``: a broadcast group spanning actor rank 0 and every engine worker:
  vLLM's ``nccl`` backend on GPUs, the ``gloo`` backend (:mod:`.gloo`) on host memory;
- ``cuda_ipc``: vLLM's ``ipc`` backend (colocated GPUs).

This package imports neither the actor nor the rollout engines (both import it);
:mod:`.vllm_backend` is imported only where vLLM is installed.
"""

from megatron_rl.weight_transfer.meta import (
    TensorMeta,
    UnknownWeightError,
    WeightUpdateError,
    check_update,
    plan_chunks,
)

__all__ = ["TensorMeta", "UnknownWeightError", "WeightUpdateError", "check_update", "plan_chunks"]
