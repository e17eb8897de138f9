"""The ``gloo`` weight-transfer backend: chunked broadcasts over a gloo group, host memory.

The same protocol as vLLM's own ``nccl`` backend (``vllm/distributed/weight_transfer/
nccl_engine.py``), with gloo instead of NCCL so that it runs on CPU machines and on
host tensors:

- **init** (once): the sender (rank 0) and every receiver join a ``torch.distributed``
  gloo group of their own (a ``TCPStore`` at the sender's address and port; it does not
  touch any default process group). Each engine is told its ``rank_offset``; a receiver
  with several workers (a vLLM engine at TP 2) gives worker ``i`` rank
  ``rank_offset + i``.
- **send** (per version): ``client.start_weight_update()``, then
  ``client.update_weights({"names", "dtype_names", "shapes"})`` runs on a side thread
  (the receivers block in it) while the sender broadcasts the tensors, chunk by chunk
  (:func:`~megatron_rl.weight_sync.meta.plan_chunks`, the same plan on both sides),
  then ``client.finish_weight_update()``.

Sender memory: one packed chunk (``chunk_bytes``) plus the tensors of the chunk being
gathered. Receivers allocate one chunk at a time and load it as it arrives.

Used three ways: actor rank 0 -> every engine (``rollout.weight_transport:
collective`` on CPU); an engine's own process -> its vLLM workers (host tensors into a
vLLM engine); and registered with vLLM as the ``megatron_rl_gloo`` backend
(``transports/vllm.py``) so both run through vLLM's weight-transfer API.
"""

from __future__ import annotations

import datetime
import logging
import socket
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl.weight_sync.meta import (
    TensorMeta,
    WeightSource,
    WeightSyncClient,
    pack_chunk,
    plan_chunks,
    unpack_chunk,
)

__all__ = [
    "GlooInitInfo",
    "GlooReceiver",
    "GlooSender",
    "free_port",
    "open_group",
    "update_info_of",
]

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 256 << 20


@dataclass(kw_only=True)
class GlooInitInfo:
    """What a receiver needs to join the sender's gloo group (sent once, as a dict)."""

    master_address: str
    """The sender's IP address."""
    master_port: int
    """The port of the sender's ``TCPStore``."""
    world_size: int
    """1 (the sender) + every receiving worker of every engine."""
    rank_offset: int = 1
    """Rank of this engine's first worker."""
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    """Most bytes per broadcast (must be equal on both sides: it fixes the chunk plan)."""
    timeout_s: float = 600.0
    """How long any side waits for the others before the transfer fails."""


def free_port() -> int:
    """A TCP port free on this host now."""
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def open_group(info: GlooInitInfo, rank: int) -> tuple[dist.ProcessGroup, dist.Store]:
    """Join (rank 0: host) the transfer group; a standalone gloo group with no global state."""
    timeout = datetime.timedelta(seconds=info.timeout_s)
    store = dist.TCPStore(
        info.master_address, info.master_port, info.world_size, rank == 0, timeout=timeout, wait_for_workers=False
    )
    group = dist.ProcessGroupGloo(dist.PrefixStore("megatron_rl_weights", store), rank, info.world_size, timeout)
    return group, store


def _broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


def update_info_of(metas: Sequence[TensorMeta]) -> dict[str, Any]:
    """The per-version ``update_info`` (vLLM's NCCL field names): the stream's metadata."""
    return {
        "names": [m.name for m in metas],
        "dtype_names": [m.dtype for m in metas],
        "shapes": [list(m.shape) for m in metas],
    }


def metas_of(update_info: dict[str, Any]) -> list[TensorMeta]:
    """Inverse of :func:`update_info_of`."""
    names, dtypes, shapes = update_info["names"], update_info["dtype_names"], update_info["shapes"]
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"update_info: {len(names)} names, {len(dtypes)} dtype_names, {len(shapes)} shapes")
    return [TensorMeta(n, d, tuple(int(x) for x in s)) for n, d, s in zip(names, dtypes, shapes)]


class GlooReceiver:
    """The receiving side of one worker: joins the group, receives chunks, hands them to ``load``."""

    def __init__(self, info: GlooInitInfo, *, worker_rank: int = 0):
        self.info = info
        self.rank = info.rank_offset + worker_rank
        self.group, self._store = open_group(info, self.rank)

    def receive(self, update_info: dict[str, Any], load: Callable[[list[tuple[str, torch.Tensor]]], Any]) -> int:
        """Receive one version's stream; ``load`` gets each chunk's ``(name, tensor)`` views
        into a buffer of that chunk's own (a loader may keep them, as vLLM's layerwise
        reload does until a layer is complete). Returns the bytes received."""
        metas = metas_of(update_info)
        total = 0
        for chunk in plan_chunks(metas, self.info.chunk_bytes):
            chunk_metas = [metas[i] for i in chunk]
            buffer = torch.empty(sum(m.num_bytes for m in chunk_metas), dtype=torch.uint8)
            _broadcast(self.group, buffer)
            load(unpack_chunk(buffer, chunk_metas))
            total += buffer.numel()
        return total

    def shutdown(self) -> None:
        self.group = None
        self._store = None


class GlooSender:
    """The sending side (mirrors vLLM's ``TrainerWeightTransferEngine``): built on every
    rank that iterates the source; only rank 0 (``is_sender``) talks to the engines."""

    backend = "gloo"

    def __init__(
        self, *, client: WeightSyncClient, source: WeightSource | None, info: GlooInitInfo, is_sender: bool
    ):
        self.client = client
        self.source = source
        self.info = info
        self.is_sender = is_sender
        self.group: dist.ProcessGroup | None = None
        self._store: dist.Store | None = None

    @classmethod
    def trainer_init(
        cls, info: GlooInitInfo, *, client: WeightSyncClient, source: WeightSource | None, is_sender: bool = True
    ) -> GlooSender:
        """Rendezvous with every receiver (the sender asks the engines to join on a side
        thread while it hosts the store); other ranks only keep the source."""
        sender = cls(client=client, source=source, info=info, is_sender=is_sender)
        if not is_sender:
            return sender
        with ThreadPoolExecutor(max_workers=1) as pool:
            future = pool.submit(client.init_weight_transfer_engine, asdict(info))
            try:
                sender.group, sender._store = open_group(info, 0)
            finally:
                future.result()  # an engine's error first: it is why the rendezvous failed
        return sender

    def send_weights(self) -> None:
        """One version: start, stream every tensor of the source, finish."""
        if not self.is_sender:
            for _ in self.source:  # take part in the gathers only
                pass
            return
        self.client.start_weight_update()
        self.stream(self.source.metadata(), iter(self.source))
        self.client.finish_weight_update()

    def stream(self, metas: list[TensorMeta], pairs: Iterator[tuple[str, torch.Tensor]]) -> int:
        """Broadcast ``pairs`` (exactly ``metas``, in order) while the receivers run
        ``client.update_weights`` on a side thread; returns the bytes sent."""
        assert self.group is not None, "trainer_init() first"
        executor = ThreadPoolExecutor(max_workers=1)
        try:
            future = executor.submit(self.client.update_weights, update_info_of(metas))
            checked = _checked(pairs, metas)
            chunk_buffer: torch.Tensor | None = None
            num_bytes = 0
            for chunk in plan_chunks(metas, self.info.chunk_bytes):
                if future.done():  # a receiver refused the update: do not wait for it in a broadcast
                    future.result()
                tensors = [next(checked)[1] for _ in chunk]
                chunk_buffer = pack_chunk(_host(tensors), out=chunk_buffer)
                _broadcast(self.group, chunk_buffer)
                num_bytes += chunk_buffer.numel()
            for _ in checked:  # runs the end-of-stream check (more or fewer tensors than listed)
                pass
            future.result()
        finally:
            # Never join a receiver that is stuck: the error must get out (the group is
            # unusable afterwards either way and is rebuilt by the caller).
            executor.shutdown(wait=False)
        return num_bytes

    def shutdown(self) -> None:
        self.group = None
        self._store = None


def _host(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [t if t.device.type == "cpu" else t.cpu() for t in tensors]


def _checked(
    pairs: Iterable[tuple[str, torch.Tensor]], metas: list[TensorMeta]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The pairs, each checked against what the receivers were told to expect."""
    sent = 0
    for name, tensor in pairs:
        if sent >= len(metas):
            raise ValueError(f"weight source yielded more tensors than its metadata lists ({len(metas)}): {name!r}")
        got = TensorMeta.of(name, tensor)
        if got != metas[sent]:
            raise ValueError(f"weight source yielded {got} where its metadata lists {metas[sent]} (index {sent})")
        sent += 1
        yield name, tensor
    if sent != len(metas):
        raise ValueError(f"weight source yielded {sent} tensors; its metadata lists {len(metas)}")
