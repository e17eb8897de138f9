"""Weights from the actor into the rollout engines: the one sync path, both of its ends,
and its transports.

Every sync is one weight *version*: the whole model as HF-named full tensors
(:class:`~megatron_rl.weight_sync.meta.TensorMeta`), checked by every engine before
anything moves (:func:`~megatron_rl.weight_sync.meta.check_update`), then moved by a
transport, then committed (the engines report the new version). The modules:

- ``sync``: :class:`~megatron_rl.weight_sync.sync.WeightSync`, the run's one sync path
  (transport choice, versions, the retry after a failure, restoring restarted engines);
- ``meta``: the metadata, the checks, the chunk plan, and the two contracts a sender is
  written against (a ``WeightSource``, a ``WeightSyncClient``);
- ``sender``: the actor's end (which sender for a backend; the engines' start-up files);
- ``receiver``: the engine's end (the update state machine every engine inherits);
- ``client``: the pool's engines as the client a sender drives, over Ray;
- ``buckets``: the object-store bucket format; ``fp8``: the block-wise FP8 wire format;
- ``transports/``: ``gloo`` (host memory), ``shm`` (a shared-memory file), ``vllm``
  (vLLM's ``nccl``/``ipc``; imported only where vLLM is installed).

Transports differ by name only (``rollout.weight_transport``): ``object_store`` (rank 0's
buckets through Ray's object store), ``shared_memory``, ``collective`` (``nccl`` on GPUs,
``gloo`` on host memory) and ``cuda_ipc`` (colocated GPUs).

May import ``config`` and ``models``; imports neither the actor nor the rollout engines
(both import it: the actor the sending side, the engines the receiving side). The actor's
weights become HF tensors in ``actor/weights.py`` (the same gather serves export).
"""

from megatron_rl.weight_sync.meta import (
    TensorMeta,
    UnknownWeightError,
    WeightUpdateError,
    check_update,
    plan_chunks,
)

__all__ = ["TensorMeta", "UnknownWeightError", "WeightUpdateError", "check_update", "plan_chunks"]
