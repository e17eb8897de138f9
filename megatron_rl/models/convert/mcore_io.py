"""Megatron dist-checkpoints (``torch_dist`` format) written and read one tensor at a time.

Format. A megatron-core ``torch_dist`` checkpoint is a torch.distributed.checkpoint
(DCP) directory (``.metadata`` + ``__<rank>_<n>.distcp`` files) plus ``metadata.json``
(backend and version) and ``common.pt`` (the non-sharded part of the state dict,
``{}`` for a GPTModel). DCP stores each *global* tensor as a set of chunks and any
reader gathers the region it needs from whatever chunks overlap it; this is how one
checkpoint loads at any TP/PP. The keys and global shapes must be those produced by
``GPTModel.sharded_state_dict()`` (see ``models/weight_units.py``): decoder-layer tensors are
stacked as ``[num_layers, ...]`` under ``decoder.layers.<suffix>``, mixture-of-experts
expert tensors as ``[num_layers, num_experts, ...]``, and every linear layer of a decoder
layer (each expert's two included) also has an ``_extra_state`` object (``None`` for the
local spec; Transformer-Engine layers accept ``None`` too; :func:`extra_state_keys`).

Writing (:func:`write_checkpoint`). ``megatron.core.dist_checkpointing.save`` needs the
whole state dict in memory and its writer copies all of it before writing. Here a
DCP ``SavePlanner`` is handed the write items (one chunk per layer per key, or per layer
per expert; shapes known from the config) and produces each chunk only when the DCP
``FileSystemWriter`` asks for it; with one writer thread, DCP requests chunks one after the other and
writes each before requesting the next. Peak memory is therefore one chunk plus its
HF sources, not the model. No process group is needed (``no_dist=True``).

Reading (:class:`DistCheckpointReader`). ``megatron.core.dist_checkpointing.load`` with
a sharded state dict describing exactly one layer row of one key (one ``[layer, expert]``
element for expert tensors) per requested tensor, so the reader validates the checkpoint
the same way a training job would and only those regions are read from disk. Each load
re-reads ``.metadata`` (megatron makes a new file-system reader per call), so callers
read many regions per call (:meth:`DistCheckpointReader.read_many`).
"""

from __future__ import annotations

import contextlib
import io
import json
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from megatron_rl.models.weight_units import ConversionError, WeightUnit, checkpoint_region

__all__ = [
    "extra_state_keys",
    "write_checkpoint",
    "DistCheckpointReader",
    "single_process_group",
]

# What megatron-core writes to metadata.json for its default torch_dist strategy.
_CHECKPOINTING_CONFIG = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}


def extra_state_keys(units: Sequence[WeightUnit], num_layers: int) -> list[str]:
    """The ``_extra_state`` objects megatron-core checkpoints beside ``units``, as DCP keys.

    Every linear layer (a module named ``linear_*``: ``linear_qkv``, ``linear_proj``,
    ``linear_fc1``, ``linear_fc2``) of a decoder layer has one, a ``ShardedObject`` with
    the leading (layer, expert) axes of its weight: the key is
    ``<module>._extra_state/shard_<offsets>_<shape>`` over those axes, joined by ``.``
    (``ShardedObject.unique_key``), e.g. ``decoder.layers.mlp.linear_fc1._extra_state/shard_3_24``
    or ``decoder.layers.mlp.experts.experts.linear_fc2._extra_state/shard_3.17_24.128``. Norms,
    the router, the embedding and the output layer have none. In unit order, without repeats.
    """
    keys: dict[str, None] = {}
    for unit in units:
        module = unit.sharded_key.rpartition(".")[0]
        if unit.layer is None or not module.rpartition(".")[2].startswith("linear_"):
            continue
        shape, offsets, _ = checkpoint_region(unit, num_layers)
        leading = 1 if unit.expert is None else 2
        where = ".".join(map(str, offsets[:leading])), ".".join(map(str, shape[:leading]))
        keys[f"{module}._extra_state/shard_{where[0]}_{where[1]}"] = None
    return list(keys)


def write_checkpoint(
    directory: Path,
    units: Sequence[WeightUnit],
    *,
    num_layers: int,
    dtypes: dict[str, torch.dtype],
    produce: Callable[[WeightUnit], torch.Tensor],
) -> int:
    """Write a megatron-core ``torch_dist`` checkpoint of ``units`` into ``directory``.

    ``produce(unit)`` returns the full Megatron tensor of one unit (shape
    ``unit.mcore_shape``, dtype ``dtypes[unit.mcore_name]``); it is called once per
    unit, lazily, in order. Each unit is one chunk at :func:`checkpoint_region`; the
    ``_extra_state`` objects of :func:`extra_state_keys` are ``None``. Returns the number
    of tensor bytes written.
    """
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    items: list[WriteItem] = []
    producers: dict[tuple[str, tuple[int, ...] | None], Callable[[], torch.Tensor | io.BytesIO]] = {}
    total_bytes = 0

    for unit in units:
        global_shape, offsets, sizes = checkpoint_region(unit, num_layers)
        dtype = dtypes[unit.mcore_name]
        index = MetadataIndex(fqn=unit.sharded_key, offset=torch.Size(offsets))
        items.append(
            WriteItem(
                index=index,
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
                    properties=TensorProperties(dtype=dtype),
                    size=torch.Size(global_shape),
                ),
            )
        )
        producers[(unit.sharded_key, tuple(offsets))] = _chunk_producer(unit, sizes, dtype, produce)
        total_bytes += torch.Size(sizes).numel() * torch.empty((), dtype=dtype).element_size()

    for key in extra_state_keys(units, num_layers):
        items.append(WriteItem(index=MetadataIndex(fqn=key), type=WriteItemType.BYTE_IO))
        producers[(key, None)] = _none_extra_state

    class StreamingSavePlanner(DefaultSavePlanner):
        """Plans the precomputed items; resolves each one only when the writer asks for it."""

        def create_local_plan(self) -> SavePlan:
            self.plan = SavePlan(items=list(items))
            return self.plan

        def resolve_data(self, write_item: WriteItem):
            offset = tuple(write_item.index.offset) if write_item.index.offset is not None else None
            return producers[(write_item.index.fqn, offset)]()

    directory = Path(directory)
    # One file per write item, not one per rank: torch's FileSystemWriter keeps the last
    # tensor written for each key alive until it closes the file (its ``tensor_dict``),
    # which with a single file would pin the embedding, the output layer and a whole
    # decoder layer until the end (measured: +1.2 GB on a 3.7 GB model).
    writer = FileSystemWriter(str(directory), single_file_per_rank=False, thread_count=1, sync_files=True)
    try:
        with warnings.catch_warnings():
            # "torch.distributed is disabled ... assuming ... a single process": intended.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp_save(
                {},
                storage_writer=writer,
                planner=StreamingSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
                no_dist=True,
            )
    except CheckpointException as e:
        raise _unwrap(e, f"writing the Megatron checkpoint into {directory} failed") from None
    torch.save({}, directory / "common.pt")
    # Written last: megatron-core treats a directory without metadata.json as incomplete.
    (directory / "metadata.json").write_text(json.dumps(_CHECKPOINTING_CONFIG))
    return total_bytes


def _unwrap(error: BaseException, context: str) -> Exception:
    """The first underlying exception of a DCP ``CheckpointException`` as a ConversionError.

    DCP collects per-rank failures into a ``CheckpointException`` (a BaseException);
    a ConversionError raised by a producer is passed through unchanged.
    """
    for failure in getattr(error, "failures", {}).values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, ConversionError):
            return inner
        return ConversionError(f"{context}: {type(inner).__name__}: {inner}")
    return ConversionError(f"{context}: {error}")


def _none_extra_state() -> io.BytesIO:
    # megatron-core serializes the ShardedObjects of one key on a rank as a list.
    buffer = io.BytesIO()
    torch.save([None], buffer)
    buffer.seek(0)
    return buffer


def _chunk_producer(
    unit: WeightUnit, sizes: tuple[int, ...], dtype: torch.dtype, produce: Callable[[WeightUnit], torch.Tensor]
) -> Callable[[], torch.Tensor]:
    def chunk() -> torch.Tensor:
        tensor = produce(unit)
        if tuple(tensor.shape) != tuple(unit.mcore_shape) or tensor.dtype != dtype:
            raise ConversionError(
                f"internal: '{unit.mcore_name}' produced {tuple(tensor.shape)} {tensor.dtype}, "
                f"planned {tuple(unit.mcore_shape)} {dtype}"
            )
        return tensor.reshape(sizes).contiguous()

    return chunk


# ----------------------------------------------------------------------------- reading


@contextlib.contextmanager
def single_process_group() -> Iterator[None]:
    """A world-size-1 gloo group for megatron's dist-checkpoint loader (needs ``get_rank``).

    Uses an in-memory store (no port). Reuses an existing group of size 1; refuses to
    run inside a larger job, where the loader's collectives would wait for other ranks.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise ConversionError(
                f"checkpoint conversion runs in a single process; torch.distributed has world size {dist.get_world_size()}"
            )
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class DistCheckpointReader:
    """Read tensors of a megatron-core ``torch_dist`` checkpoint by layer rows (or by
    experts of one layer), a few at a time.

    ``tensors`` maps every stored tensor key to ``(global shape, dtype)``. Reads need
    :func:`single_process_group` (or an initialized world of size 1).
    """

    def __init__(self, directory: Path):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise ConversionError(f"Megatron checkpoint directory not found: {self.directory}")
        config_path = self.directory / "metadata.json"
        if not config_path.is_file():
            raise ConversionError(f"not a Megatron dist-checkpoint (no metadata.json): {self.directory}")
        try:
            backend = json.loads(config_path.read_text()).get("sharded_backend")
        except (OSError, ValueError, AttributeError) as e:
            raise ConversionError(f"{config_path} is not valid JSON: {e}") from e
        if backend != "torch_dist":
            raise ConversionError(f"{config_path}: sharded_backend={backend!r}; only 'torch_dist' checkpoints are supported")
        if not (self.directory / ".metadata").is_file():
            raise ConversionError(f"Megatron checkpoint {self.directory} has no DCP .metadata file")
        try:
            self._metadata = FileSystemReader(str(self.directory)).read_metadata()
        except Exception as e:
            raise ConversionError(f"{self.directory / '.metadata'} is corrupt or unreadable: {e}") from e
        self.tensors: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
            key: (tuple(md.size), md.properties.dtype)
            for key, md in self._metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)
        }
        self._files: dict[str, set[str]] = {}
        # (key, leading offsets) -> files; a chunk's leading offsets name its layer and expert.
        self._chunk_files: dict[tuple[str, tuple[int, ...]], set[str]] = {}
        for index, info in self._metadata.storage_data.items():
            self._files.setdefault(index.fqn, set()).add(info.relative_path)
            offset = tuple(index.offset or ())
            for lead in range(1, min(len(offset), 2) + 1):
                self._chunk_files.setdefault((index.fqn, offset[:lead]), set()).add(info.relative_path)
        for relative_path in sorted({p for paths in self._files.values() for p in paths}):
            if not (self.directory / relative_path).is_file():
                keys = sorted(k for k, paths in self._files.items() if relative_path in paths)
                raise ConversionError(
                    f"checkpoint file {self.directory / relative_path} is missing (it holds '{keys[0]}' and {len(keys) - 1} more)"
                )

    def files(self, key: str, index: Sequence[int] = ()) -> list[str]:
        """Paths of the checkpoint files holding chunks of ``key`` (for error messages); with
        ``index``, only of the chunks whose offsets start with it (one layer, one expert)."""
        names = self._files.get(key, set()) if not index else self._chunk_files.get((key, tuple(index)), set())
        return [str(self.directory / name) for name in sorted(names)]

    def read(self, key: str, layer: int | None = None, expert: int | None = None) -> torch.Tensor:
        """The global tensor ``key``; its row ``layer`` (without the layer dim) when given;
        element ``[layer, expert]`` (without both dims) of an expert tensor
        ``[num_layers, num_experts, ...]`` when ``expert`` is given too."""
        return self.read_many([(key, layer, expert)])[0]

    def read_many(self, requests: Sequence[tuple[str, int | None, int | None]]) -> list[torch.Tensor]:
        """:meth:`read` of each ``(key, layer, expert)`` in ``requests``, in one
        ``dist_checkpointing.load`` call (all of them are in memory together).

        Each call re-reads the checkpoint's ``.metadata``, whose size grows with the number
        of chunks (one per layer per key, and per expert), so reading many regions at once
        is much faster than reading them one by one. When the call fails, the requests are
        read one by one, so that the error names the tensor and the file at fault.
        """
        try:
            return self._load(requests)
        except ConversionError:
            if len(requests) > 1:
                for request in requests:
                    self._load([request])
            raise

    def _load(self, requests: Sequence[tuple[str, int | None, int | None]]) -> list[torch.Tensor]:
        from torch.distributed.checkpoint.api import CheckpointException

        with warnings.catch_warnings():
            # Expected without CUDA: "Transformer Engine and Apex are not installed".
            warnings.filterwarnings("ignore", message=".*Apex are not installed.*", category=UserWarning)
            from megatron.core import dist_checkpointing
            from megatron.core.dist_checkpointing import ShardedTensor

        sharded, shapes, where = {}, [], []
        for n, (key, layer, expert) in enumerate(requests):
            if expert is not None and layer is None:
                raise ValueError("read(): an expert index needs a layer index")
            shape, dtype = self.tensors[key]
            index = () if layer is None else (layer,) if expert is None else (layer, expert)
            if len(index) > len(shape) or any(not 0 <= i < size for i, size in zip(index, shape)):
                raise ConversionError(f"cannot read element {list(index)} of tensor '{key}' of shape {list(shape)}")
            # The region a rank holding one layer (and one expert) would request: fragment i
            # of shape[axis] equal fragments along each leading axis.
            buffer = torch.empty((*(1,) * len(index), *shape[len(index) :]), dtype=dtype)
            offsets = [(axis, i, shape[axis]) for axis, i in enumerate(index)]
            sharded[f"t{n}"] = ShardedTensor.from_rank_offsets(key, buffer, *offsets, replica_id=0)
            shapes.append(shape[len(index) :])
            label = "" if layer is None else f" (layer {layer}{'' if expert is None else f', expert {expert}'})"
            where.append((key, label, self.files(key, index) or self.files(key)))
        key, label, files = where[0]
        more = f" and {len(where) - 1} more tensors" if len(where) > 1 else ""
        names = sorted({f for _, _, fs in where for f in fs})
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more files" if len(names) > 3 else "")
        context = f"cannot read tensor '{key}'{label}{more} from {shown or self.directory}"
        try:
            with warnings.catch_warnings():
                # megatron-core 0.16 calls the deprecated DCP load_state_dict.
                warnings.filterwarnings("ignore", message=".*load_state_dict.*deprecated", category=FutureWarning)
                loaded = dist_checkpointing.load(sharded, str(self.directory), validate_access_integrity=False)
        except CheckpointException as e:
            raise _unwrap(e, context) from None
        except Exception as e:
            raise ConversionError(f"{context}: {type(e).__name__}: {e}") from e
        return [loaded[f"t{n}"].reshape(shape) for n, shape in enumerate(shapes)]
