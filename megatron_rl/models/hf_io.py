"""HF checkpoint files, one tensor at a time: safetensors reads and writes, config and tokenizer.

Reading. :class:`SafetensorsReader` indexes every tensor of a checkpoint from the
shard headers (names, shapes, dtypes; no data) and :meth:`SafetensorsReader.read`
opens the shard for each tensor. ``safetensors.safe_open`` memory-maps the file and
``get_tensor`` returns a tensor backed by that mapping; pages touched while the file
is open stay resident (and count in RSS) until it is closed, so keeping one handle
open for a whole shard would grow the process by the shard size. One open per tensor
bounds it by the tensors alive at a time.

Writing. A safetensors file is ``u64 header length | JSON header | raw bytes``; the
header needs every name, shape, dtype and offset, all of which a converter knows
before it has any data. :class:`SafetensorsShardWriter` plans the shards up front,
writes each header, then appends tensors as they are produced, so nothing but the
current tensor is held in memory (``safetensors.torch.save_file`` would need a whole
shard). Shards follow the HF naming (``model.safetensors`` alone, else
``model-00001-of-0000N.safetensors`` with ``model.safetensors.index.json``).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from megatron_rl.models.weight_units import ConversionError

__all__ = [
    "HF_AUX_FILES",
    "TensorSpec",
    "SafetensorsReader",
    "SafetensorsShardWriter",
    "read_config",
    "copy_aux_files",
    "dtype_from_name",
]

INDEX_FILE = "model.safetensors.index.json"

# Files that travel with the weights: model config, generation defaults, tokenizer.
HF_AUX_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)

_ST_TO_TORCH = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_TORCH_TO_ST = {v: k for k, v in _ST_TO_TORCH.items()}

_DTYPE_NAMES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
}


def dtype_from_name(name: str) -> torch.dtype:
    """``bf16``/``fp16``/``fp32`` (or the long torch names) -> torch dtype."""
    try:
        return _DTYPE_NAMES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; allowed: bf16, fp16, fp32") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class TensorSpec:
    """Name, shape and dtype of one tensor (enough to place it in a safetensors file)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    file: Path | None = None
    """The shard holding it (reader side)."""

    @property
    def nbytes(self) -> int:
        numel = 1
        for s in self.shape:
            numel *= s
        return numel * torch.empty((), dtype=self.dtype).element_size()


def read_config(directory: Path) -> dict[str, Any]:
    """Parse ``directory/config.json``; a missing or invalid file raises ConversionError."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise ConversionError(f"HF config not found: {path}")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConversionError(f"HF config {path} is not valid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise ConversionError(f"HF config {path} is not a JSON object")
    return cfg


def copy_aux_files(src: Path, dst: Path, *, skip: Iterable[str] = ()) -> list[str]:
    """Copy the :data:`HF_AUX_FILES` present in ``src`` to ``dst``; returns the names copied."""
    skip = set(skip)
    copied = []
    for name in HF_AUX_FILES:
        if name in skip or not (Path(src) / name).is_file():
            continue
        shutil.copy2(Path(src) / name, Path(dst) / name)
        copied.append(name)
    return copied


# ----------------------------------------------------------------------------- reading


def _read_header(path: Path) -> dict[str, TensorSpec]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            specs = {}
            for name in f.keys():
                piece = f.get_slice(name)
                dtype = _ST_TO_TORCH.get(piece.get_dtype())
                if dtype is None:
                    raise ConversionError(f"safetensors file {path}: tensor '{name}' has unsupported dtype {piece.get_dtype()}")
                specs[name] = TensorSpec(name=name, shape=tuple(piece.get_shape()), dtype=dtype, file=path)
            return specs
    except ConversionError:
        raise
    except Exception as e:  # SafetensorError, OSError: truncated, garbage or unreadable shard
        raise ConversionError(f"safetensors file {path} is corrupt or unreadable: {e}") from e


class SafetensorsReader:
    """Tensor index of an HF checkpoint directory; reads single tensors on demand."""

    def __init__(self, directory: Path, entries: dict[str, TensorSpec]):
        self.directory = Path(directory)
        self.entries = entries
        """``{tensor name: TensorSpec}`` over all shards."""

    @classmethod
    def open(cls, directory: Path) -> "SafetensorsReader":
        """Index ``directory`` through ``model.safetensors.index.json`` or its ``*.safetensors`` files."""
        directory = Path(directory)
        index_path = directory / INDEX_FILE
        expected: dict[str, str] = {}
        if index_path.is_file():
            try:
                expected = dict(json.loads(index_path.read_text())["weight_map"])
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ConversionError(f"safetensors index {index_path} is invalid: {e}") from e
            files = sorted(set(expected.values()))
            for file in files:
                if not (directory / file).is_file():
                    names = sorted(n for n, f in expected.items() if f == file)
                    raise ConversionError(
                        f"shard {directory / file} listed in {index_path.name} is missing "
                        f"(it holds {len(names)} tensors, e.g. '{names[0]}')"
                    )
        else:
            files = sorted(p.name for p in directory.glob("*.safetensors"))
            if not files:
                has_bin = any(directory.glob("pytorch_model*.bin"))
                hint = " (pytorch_model*.bin found: only safetensors checkpoints are supported)" if has_bin else ""
                raise ConversionError(f"no safetensors weights in {directory}{hint}")
        entries: dict[str, TensorSpec] = {}
        for file in files:
            for name, spec in _read_header(directory / file).items():
                if name in entries:
                    raise ConversionError(f"tensor '{name}' appears in both {entries[name].file} and {spec.file}")
                entries[name] = spec
        for name, file in expected.items():
            if name not in entries:
                raise ConversionError(f"{index_path.name} maps tensor '{name}' to {directory / file}, which does not contain it")
            if entries[name].file.name != file:
                raise ConversionError(f"{index_path.name} maps tensor '{name}' to {file}, but it is in {entries[name].file}")
        return cls(directory, entries)

    def read(self, name: str) -> torch.Tensor:
        """The tensor ``name`` (memory-mapped; its pages are released when it is dropped)."""
        from safetensors import safe_open

        spec = self.entries[name]
        try:
            with safe_open(str(spec.file), framework="pt") as f:
                return f.get_tensor(name)
        except Exception as e:
            raise ConversionError(f"cannot read tensor '{name}' from {spec.file}: {e}") from e


# ----------------------------------------------------------------------------- writing


def plan_shards(specs: Sequence[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Split ``specs`` (in order) into shards of at most ``max_shard_bytes``.

    A tensor larger than the limit gets a shard of its own (like HF's sharding).
    """
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards if shards[0] else []


def _header_bytes(shard: Sequence[TensorSpec]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in shard:
        header[spec.name] = {
            "dtype": _TORCH_TO_ST[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


class SafetensorsShardWriter:
    """Stream tensors into planned HF safetensors shards.

    ``write`` must be called once per planned tensor, in plan order, with a tensor of
    the planned shape and dtype; ``finish`` checks completeness and writes the index.
    """

    def __init__(self, directory: Path, specs: Sequence[TensorSpec], *, max_shard_bytes: int):
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        for spec in specs:
            if spec.dtype not in _TORCH_TO_ST:
                raise ConversionError(f"tensor '{spec.name}' has dtype {spec.dtype}, which safetensors cannot store")
        self.directory = Path(directory)
        self.shards = plan_shards(specs, max_shard_bytes)
        n = len(self.shards)
        self.file_names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        self._order = [(s, spec) for s, shard in enumerate(self.shards) for spec in shard]
        self._next = 0
        self._file = None
        self.bytes_written = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append the next planned tensor."""
        if self._next >= len(self._order):
            raise ConversionError(f"unplanned tensor '{name}' (all planned tensors are written)")
        shard_idx, spec = self._order[self._next]
        if name != spec.name:
            raise ConversionError(f"tensor '{name}' written out of order; expected '{spec.name}'")
        if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
            raise ConversionError(
                f"tensor '{name}' is {tuple(tensor.shape)} {tensor.dtype}; planned {spec.shape} {spec.dtype}"
            )
        if self._file is None:
            self._file = open(self.directory / self.file_names[shard_idx], "wb")
            self._file.write(_header_bytes(self.shards[shard_idx]))
        flat = tensor.detach().contiguous().reshape(-1)
        if flat.numel():
            self._file.write(memoryview(flat.view(torch.uint8).numpy()))
        self.bytes_written += spec.nbytes
        self._next += 1
        last_of_shard = self._next == len(self._order) or self._order[self._next][0] != shard_idx
        if last_of_shard:
            self._file.close()
            self._file = None

    def finish(self) -> dict[str, str]:
        """Check every planned tensor was written, write the index (several shards); return the weight map."""
        if self._next != len(self._order):
            missing = self._order[self._next][1].name
            raise ConversionError(f"{len(self._order) - self._next} planned tensors were not written, first '{missing}'")
        weight_map = {spec.name: self.file_names[s] for s, spec in self._order}
        if len(self.file_names) > 1:
            index = {"metadata": {"total_size": self.bytes_written}, "weight_map": weight_map}
            (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        return weight_map

    def close(self) -> None:
        """Close an open shard (error paths)."""
        if self._file is not None:
            self._file.close()
            self._file = None
