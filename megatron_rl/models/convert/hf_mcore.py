"""HF safetensors <-> megatron-core dist-checkpoints, streaming: :func:`hf_to_mcore`, :func:`mcore_to_hf`.

::

    hf_to_mcore(HfToMcoreOptions(hf_dir=Path("/ckpt/Qwen2.5-7B-Instruct"), out_dir=Path("/ckpt/q7b-mcore"), tp=4))
    mcore_to_hf(McoreToHfOptions(mcore_dir=Path("/ckpt/q7b-mcore"), out_dir=Path("/ckpt/q7b-hf")))

The command line over these is ``megatron-rl convert hf-to-mcore|mcore-to-hf``
(:mod:`megatron_rl.cli.convert`), whose ``--tp``/``--pp``/``--ep``/``--etp`` are the
options' ``tp``/``pp``/``ep``/``etp``.

The Megatron side is a megatron-core ``torch_dist`` checkpoint whose keys and global
shapes are those of ``GPTModel.sharded_state_dict()``, so ``dist_checkpointing.load``
fills a GPTModel built at *any* TP/PP/EP/ETP; ``tp`` only chooses the vocabulary padding
(rows rounded up to ``make_vocab_size_divisible_by * tp``; other sizes load too,
megatron-core marks the embedding as ``allow_shape_mismatch``) and ``tp``/``pp``/``ep``/``etp``
are checked against the model's head, group, layer and expert counts. Mixture-of-experts
models (Qwen3-MoE) convert one expert projection at a time: expert ``j`` of layer ``i``
is element ``[i, j]`` of its key (:func:`~megatron_rl.models.weight_units.checkpoint_region`).
The HF config, generation config and tokenizer files are kept in ``<out>/hf_config/`` for
the way back.

Both directions stream, never holding the model: hf-to-mcore has one HF tensor (or one
layer row, or one expert, of one Megatron tensor) in memory at a time; mcore-to-hf reads
consecutive Megatron tensors together up to the size of the largest one, because each
read re-reads the checkpoint's metadata (see :func:`_read_batches`, docs/conversion.md and
``benchmarks/convert_memory.py``). Output appears atomically: everything is written
into a temporary sibling directory that is renamed into place at the end and removed
on any error. Bad input raises :class:`ConversionError` naming the file and tensor; so
does a full disk (checked against the output's size before writing, and ``ENOSPC`` /
``EDQUOT`` while writing) or another I/O error. An HF directory without tokenizer files
converts with a :class:`ConversionWarning`: a run from the checkpoint then needs
``model.tokenizer``, and the way back exports none.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from megatron_rl.models.common import DecoderAdapter, ModelDims, padded_vocab_size
from megatron_rl.models.convert.lora_export import (
    ADAPTER_SUFFIXES,
    LoRAExport,
    adapted_units,
    adapter_keys,
    merge_adapter,
    peft_tensors,
    write_peft_adapter,
)
from megatron_rl.models.hf_io import (
    HF_AUX_FILES,
    SafetensorsReader,
    SafetensorsShardWriter,
    TensorSpec,
    copy_aux_files,
    dtype_from_name,
    read_config,
)
from megatron_rl.models.moe import MoEDecoderAdapter
from megatron_rl.models.registry import adapter_for_config
from megatron_rl.models.weight_units import ConversionError, WeightUnit, checkpoint_region

__all__ = [
    "ConversionError",
    "ConversionWarning",
    "HfToMcoreOptions",
    "McoreToHfOptions",
    "ConversionSummary",
    "hf_to_mcore",
    "mcore_to_hf",
    "HF_CONFIG_SUBDIR",
    "RECORD_FILE",
]

HF_CONFIG_SUBDIR = "hf_config"
"""Where hf-to-mcore keeps config.json, generation_config.json and tokenizer files."""
RECORD_FILE = "megatron_rl_conversion.json"
"""Conversion record written next to the Megatron checkpoint (informational)."""
TOKENIZER_FILES = tuple(n for n in HF_AUX_FILES if n not in ("config.json", "generation_config.json"))
"""Files of :data:`HF_AUX_FILES` that make up a tokenizer."""

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class ConversionWarning(UserWarning):
    """A conversion that succeeded but lacks something a user will likely need."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class HfToMcoreOptions:
    """Options of :func:`hf_to_mcore` (``megatron-rl convert hf-to-mcore``)."""

    hf_dir: Path
    """HF model directory: config.json + safetensors (index or single file)."""
    out_dir: Path
    """Output directory; must not exist or be empty."""
    tp: int = 1
    """Tensor-parallel size the checkpoint is padded and checked for (it loads at any TP)."""
    pp: int = 1
    """Pipeline-parallel size the layer count is checked against (it loads at any PP)."""
    ep: int = 1
    """Expert-parallel size the number of experts is checked against (it loads at any EP);
    a dense model takes only 1."""
    etp: int | None = None
    """Expert tensor-parallel size the expert width is checked against (it loads at any
    ETP); None: ``tp`` (megatron's default). Mixture-of-experts models only."""
    make_vocab_size_divisible_by: int = 128
    """Embedding rows are padded to a multiple of this times ``tp`` (Megatron-LM convention)."""
    dtype: str | None = None
    """Cast every tensor to bf16/fp16/fp32; None keeps the HF dtypes."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep", "etp", "make_vocab_size_divisible_by"):
            value = getattr(self, name)
            if name == "etp" and value is None:  # megatron's default: tp
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} (--{name.replace('_', '-')}) must be an integer >= 1, got {value!r}")
        if self.dtype is not None:
            dtype_from_name(self.dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class McoreToHfOptions:
    """Options of :func:`mcore_to_hf` (``megatron-rl convert mcore-to-hf``)."""

    mcore_dir: Path
    """megatron-core torch_dist checkpoint directory (has metadata.json)."""
    out_dir: Path | None
    """Output directory of the HF model (with a LoRA checkpoint's adapters merged); must not
    exist or be empty. None: no model (``peft_dir`` only)."""
    lora: LoRAExport | None = None
    """The adapters the checkpoint holds (its ``actor_state.json``); None: it must hold none."""
    peft_dir: Path | None = None
    """Output directory of the adapters in PEFT's format (``lora`` required); must not exist or be empty."""
    hf_config_dir: Path | None = None
    """Directory with config.json (+ generation/tokenizer files); default ``<mcore_dir>/hf_config``."""
    max_shard_bytes: int = 5 * 10**9
    """Upper bound of one safetensors shard (a larger single tensor gets its own shard)."""
    dtype: str | None = None
    """Cast every tensor to bf16/fp16/fp32; None keeps the checkpoint dtypes."""

    def __post_init__(self) -> None:
        if self.max_shard_bytes < 1:
            raise ValueError(f"max_shard_bytes must be >= 1, got {self.max_shard_bytes}")
        if self.out_dir is None and self.peft_dir is None:
            raise ValueError("nothing to write: give out_dir (--out), peft_dir (--peft-out) or both")
        if self.dtype is not None:
            dtype_from_name(self.dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConversionSummary:
    """What a conversion wrote."""

    out_dir: Path
    model_type: str
    num_tensors: int
    """Megatron parameters (hf-to-mcore) or HF tensors (mcore-to-hf) written."""
    tensor_bytes: int
    seconds: float


# ----------------------------------------------------------------------------- shared


def _is_no_space(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it) is a full disk or an exceeded quota. DCP's wrapped
    errors keep only the message, so that is read too."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _NO_SPACE:
            return True
        seen = seen.__cause__ or seen.__context__
    return any(os.strerror(code) in str(error) for code in _NO_SPACE)


def _gib(num_bytes: float) -> str:
    """A byte count for people: ``3.20 GiB``, ``12.5 MiB``, ``40 KiB``."""
    if num_bytes >= 2**30:
        return f"{num_bytes / 2**30:.2f} GiB"
    return f"{num_bytes / 2**20:.1f} MiB" if num_bytes >= 2**20 else f"{num_bytes / 2**10:.0f} KiB"


@contextlib.contextmanager
def _atomic_output_dir(out_dir: Path, *, needed_bytes: int = 0) -> Iterator[Path]:
    """Yield a temporary sibling of ``out_dir``; rename it into place on success, delete it on error.

    Refuses up front when the file system has less than ``needed_bytes`` free; a full disk
    or another I/O error while writing becomes a :class:`ConversionError` saying so.
    """
    out_dir = Path(out_dir).absolute()
    if out_dir.exists():
        if not out_dir.is_dir():
            raise ConversionError(f"output path {out_dir} exists and is not a directory")
        if any(out_dir.iterdir()):
            raise ConversionError(f"output directory {out_dir} is not empty")
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
        free = shutil.disk_usage(tmp).free
    except OSError as e:
        raise ConversionError(f"cannot create the output directory {out_dir}: {e.strerror or e}") from None
    if needed_bytes > free:
        tmp.rmdir()
        raise ConversionError(
            f"not enough space for {out_dir}: the output needs about {_gib(needed_bytes)}, "
            f"its file system has {_gib(free)} free"
        )
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp creates 0700
    try:
        yield tmp
        # rename() replaces an empty directory atomically on POSIX.
        os.rename(tmp, out_dir)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if _is_no_space(e):
            free = shutil.disk_usage(out_dir.parent).free
            raise ConversionError(
                f"no space left on the device while writing {out_dir} (about {_gib(needed_bytes)} needed, "
                f"{_gib(free)} free now); the partial output was removed"
            ) from None
        if isinstance(e, OSError):
            raise ConversionError(f"I/O error during the conversion to {out_dir}: {e}") from None
        raise


def _check_parallel(adapter: DecoderAdapter, cfg: dict, options: HfToMcoreOptions, padded_vocab: int) -> None:
    """The model divides among ``options``' TP/PP/EP ranks; the error names the field and the flag.

    Experts are split over ``ep`` ranks and each expert over the expert tensor-parallel
    size ``etp`` (``tp`` when None, megatron's default); a MoE model has no dense MLP, so
    its ``intermediate_size`` is not checked.
    """
    dims = adapter.dims(cfg)
    tp, pp, ep = options.tp, options.pp, options.ep
    checks = [
        ("num_attention_heads", dims.num_attention_heads, "tensor", tp),
        ("num_key_value_heads", dims.num_query_groups, "tensor", tp),
        ("padded vocab size", padded_vocab, "tensor", tp),
        ("num_hidden_layers", dims.num_layers, "pipeline", pp),
    ]
    if isinstance(adapter, MoEDecoderAdapter):
        moe = adapter.moe_dims(cfg)
        checks += [
            ("moe_intermediate_size", moe.moe_ffn_hidden_size, "expert-tensor" if options.etp else "tensor",
             options.etp or tp),
            ("num_experts", moe.num_moe_experts, "expert", ep),
        ]
    else:
        checks.append(("intermediate_size", dims.ffn_hidden_size, "tensor", tp))
        if ep != 1:
            raise ConversionError(
                f"--ep {ep}: expert parallelism applies to mixture-of-experts models; model_type "
                f"{dims.model_type!r} has no experts (use --ep 1)"
            )
        if options.etp is not None:
            raise ConversionError(
                f"--etp {options.etp}: expert tensor parallelism applies to mixture-of-experts models; model_type "
                f"{dims.model_type!r} has no experts (leave --etp out)"
            )
    flags = {"tensor": "--tp", "pipeline": "--pp", "expert": "--ep", "expert-tensor": "--etp"}
    for what, value, kind, size in checks:
        if value % size:
            raise ConversionError(
                f"{what}={value} is not divisible by the {kind}-parallel size {size} ({flags[kind]} {size})"
            )


def _target_dtype(option: str | None, native: torch.dtype) -> torch.dtype:
    return dtype_from_name(option) if option is not None else native


# ----------------------------------------------------------------------------- hf -> mcore


def _check_hf_tensors(reader: SafetensorsReader, units: list[WeightUnit], adapter: DecoderAdapter, cfg: dict) -> None:
    """Every tensor the config implies exists with its shape; nothing else is present."""
    expected = set()
    for unit in units:
        for name, shape in zip(unit.hf_names, unit.hf_shapes):
            expected.add(name)
            spec = reader.entries.get(name)
            if spec is None:
                raise ConversionError(
                    f"HF checkpoint {reader.directory} is missing tensor '{name}' "
                    f"(required by config.json: model_type={cfg.get('model_type')}, "
                    f"num_hidden_layers={cfg.get('num_hidden_layers')})"
                )
            if spec.shape != tuple(shape):
                if unit.kind == "vocab" and spec.shape[1:] == tuple(shape[1:]):
                    raise ConversionError(
                        f"vocab size mismatch: config.json has vocab_size={shape[0]} but tensor '{name}' "
                        f"in {spec.file} has {spec.shape[0]} rows"
                    )
                raise ConversionError(
                    f"tensor '{name}' in {spec.file} has shape {list(spec.shape)}; config.json implies {list(shape)}"
                )
        dtypes = {reader.entries[n].dtype for n in unit.hf_names}
        if len(dtypes) > 1:
            raise ConversionError(f"tensors {list(unit.hf_names)} have mixed dtypes {sorted(map(str, dtypes))}")
    ignorable = adapter.ignorable_hf_names(cfg)
    unexpected = sorted(n for n in reader.entries if n not in expected and not ignorable(n))
    if unexpected:
        first = reader.entries[unexpected[0]]
        more = f" and {len(unexpected) - 1} more" if len(unexpected) > 1 else ""
        raise ConversionError(
            f"unexpected tensor '{first.name}' in {first.file}{more}: not part of a "
            f"{cfg.get('model_type')} model with this config.json"
        )


def hf_to_mcore(options: HfToMcoreOptions) -> ConversionSummary:
    """Convert an HF safetensors checkpoint into a megatron-core torch_dist checkpoint."""
    from megatron_rl.models.convert.mcore_io import write_checkpoint

    start = time.perf_counter()
    hf_dir = Path(options.hf_dir)
    cfg = read_config(hf_dir)
    adapter = adapter_for_config(cfg)
    dims = adapter.dims(cfg)
    vocab = padded_vocab_size(dims.vocab_size, tp_size=options.tp, divisible_by=options.make_vocab_size_divisible_by)
    _check_parallel(adapter, cfg, options, vocab)
    units = adapter.weight_units(cfg, padded_vocab_size=vocab)
    reader = SafetensorsReader.open(hf_dir)
    _check_hf_tensors(reader, units, adapter, cfg)
    dtypes = {u.mcore_name: _target_dtype(options.dtype, reader.entries[u.hf_names[0]].dtype) for u in units}

    def produce(unit: WeightUnit) -> torch.Tensor:
        tensors = {name: reader.read(name).to(dtypes[unit.mcore_name]) for name in unit.hf_names}
        return adapter.hf_to_mcore(unit, tensors)

    needed = sum(
        TensorSpec(name=n, shape=reader.entries[n].shape, dtype=dtypes[u.mcore_name]).nbytes
        for u in units
        for n in u.hf_names
    )
    with _atomic_output_dir(options.out_dir, needed_bytes=needed) as tmp:
        tensor_bytes = write_checkpoint(tmp, units, num_layers=dims.num_layers, dtypes=dtypes, produce=produce)
        (tmp / HF_CONFIG_SUBDIR).mkdir()
        copied = copy_aux_files(hf_dir, tmp / HF_CONFIG_SUBDIR)
        if not set(copied) & set(TOKENIZER_FILES):
            warnings.warn(
                ConversionWarning(
                    f"{hf_dir} has no tokenizer files (tokenizer.json, tokenizer.model, vocab.json, ...): a run "
                    "from this checkpoint needs model.tokenizer, and mcore-to-hf will export none"
                ),
                stacklevel=2,
            )
        record = {
            "format_version": 1,
            "direction": "hf-to-mcore",
            "source": str(hf_dir.absolute()),
            "model_type": dims.model_type,
            "num_layers": dims.num_layers,
            "vocab_size": dims.vocab_size,
            "padded_vocab_size": vocab,
            "make_vocab_size_divisible_by": options.make_vocab_size_divisible_by,
            "tensor_model_parallel_size": options.tp,
            "pipeline_model_parallel_size": options.pp,
            "expert_model_parallel_size": options.ep,
            "expert_tensor_parallel_size": options.etp or options.tp,
            "dtypes": sorted({str(d).removeprefix("torch.") for d in dtypes.values()}),
        }
        (tmp / RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return ConversionSummary(
        out_dir=Path(options.out_dir).absolute(),
        model_type=dims.model_type,
        num_tensors=len(units),
        tensor_bytes=tensor_bytes,
        seconds=time.perf_counter() - start,
    )


# ----------------------------------------------------------------------------- mcore -> hf


_MODEL_KEY_PREFIXES = ("embedding.", "decoder.", "output_layer.")


def _check_mcore_tensors(reader, units: list[WeightUnit], dims: ModelDims, cfg_path: Path,
                         lora: LoRAExport | None, *, weights: bool = True) -> None:  # fmt: skip
    """Every unit's key exists with the shape the config implies (``weights``; an adapter-only
    checkpoint holds none) and the adapter of each unit ``lora`` adapts; no other model
    tensor is stored."""
    expected = set()
    if lora is not None:
        for unit in adapted_units(units, lora):
            for key in adapter_keys(unit):
                if key not in reader.tensors:
                    raise ConversionError(f"Megatron checkpoint {reader.directory} is missing adapter tensor '{key}' "
                                          f"(its actor_state.json records LoRA on {list(lora.target_modules)})")  # fmt: skip
                expected.add(key)
    elif any(k.endswith(ADAPTER_SUFFIXES) for k in reader.tensors):
        key = next(k for k in reader.tensors if k.endswith(ADAPTER_SUFFIXES))
        raise ConversionError(f"Megatron checkpoint {reader.directory} holds LoRA adapters ('{key}') but records no "
                              "LoRA settings (actor_state.json 'lora'): cannot merge them")  # fmt: skip
    for unit in units if weights else ():
        expected.add(unit.sharded_key)
        if unit.sharded_key not in reader.tensors:
            raise ConversionError(
                f"Megatron checkpoint {reader.directory} is missing tensor '{unit.sharded_key}' "
                f"(required by {cfg_path})"
            )
        shape, _ = reader.tensors[unit.sharded_key]
        files = ", ".join(reader.files(unit.sharded_key))
        if unit.kind == "vocab":
            if len(shape) != 2 or shape[1] != dims.hidden_size:
                raise ConversionError(
                    f"tensor '{unit.sharded_key}' in {files} has shape {list(shape)}; expected [>= {dims.vocab_size}, {dims.hidden_size}]"
                )
            if shape[0] < dims.vocab_size:
                raise ConversionError(
                    f"vocab size mismatch: {cfg_path} has vocab_size={dims.vocab_size} but tensor "
                    f"'{unit.sharded_key}' in {files} has only {shape[0]} rows"
                )
            continue
        want = checkpoint_region(unit, dims.num_layers)[0]
        if tuple(shape) != want:
            raise ConversionError(
                f"tensor '{unit.sharded_key}' in {files} has shape {list(shape)}; {cfg_path} implies {list(want)}"
            )
    unexpected = sorted(k for k in reader.tensors if k.startswith(_MODEL_KEY_PREFIXES) and k not in expected)
    if unexpected:
        more = f" and {len(unexpected) - 1} more" if len(unexpected) > 1 else ""
        raise ConversionError(
            f"unexpected tensor '{unexpected[0]}' in {', '.join(reader.files(unexpected[0]))}{more}: "
            f"not part of a {dims.model_type} model with {cfg_path}"
            + (" (tie_word_embeddings=true)" if unexpected[0] == "output_layer.weight" else "")
        )


def _read_batches(units: list[WeightUnit], reader) -> Iterator[list[WeightUnit]]:
    """``units`` in order, in the groups that :meth:`DistCheckpointReader.read_many` reads together:
    consecutive units of at most the bytes of the largest unit (usually the embedding).

    Every ``dist_checkpointing.load`` re-reads the checkpoint's ``.metadata``, which grows
    with the number of chunks (one per layer per key, and per expert: about 25,000 for
    Qwen3-30B-A3B, where one read per unit would re-read it about 12,000 times). Grouping
    up to the largest unit keeps the peak memory where one large unit puts it anyway.
    """

    def nbytes(unit: WeightUnit) -> int:
        dtype = reader.tensors[unit.sharded_key][1]
        return int(torch.Size(unit.mcore_shape).numel()) * torch.empty((), dtype=dtype).element_size()

    budget = max((nbytes(u) for u in units), default=0)
    batch: list[WeightUnit] = []
    size = 0
    for unit in units:
        if batch and size + nbytes(unit) > budget:
            yield batch
            batch, size = [], 0
        batch.append(unit)
        size += nbytes(unit)
    if batch:
        yield batch


def mcore_to_hf(options: McoreToHfOptions) -> ConversionSummary:
    """Convert a megatron-core torch_dist checkpoint into HF safetensors shards (a LoRA
    checkpoint's adapters merged; an adapter-only one's base read from ``lora.base_dir``)
    and/or its adapters into a PEFT adapter directory."""
    from megatron_rl.models.convert.mcore_io import DistCheckpointReader, single_process_group

    start = time.perf_counter()
    mcore_dir, lora = Path(options.mcore_dir), options.lora
    reader = DistCheckpointReader(mcore_dir)
    cfg_dir = Path(options.hf_config_dir) if options.hf_config_dir is not None else mcore_dir / HF_CONFIG_SUBDIR
    if not (cfg_dir / "config.json").is_file():
        raise ConversionError(f"no HF config.json in {cfg_dir}; pass --hf-config DIR")
    if options.peft_dir is not None and lora is None:
        raise ConversionError(f"--peft-out: checkpoint {mcore_dir} holds no LoRA adapters (its actor_state.json records none)")
    cfg = read_config(cfg_dir)
    adapter = adapter_for_config(cfg)
    dims = adapter.dims(cfg)
    write_model = options.out_dir is not None
    # Where the (base) weights are: the checkpoint, or an adapter-only checkpoint's base.
    weights, hf_base = reader, None
    base_dir = lora.base_dir if lora is not None else None
    if base_dir is not None and write_model:
        if (Path(base_dir) / "metadata.json").is_file():
            weights = DistCheckpointReader(Path(base_dir))
        else:
            hf_base = SafetensorsReader.open(Path(base_dir))
    # The stored padding depends on the TP size the checkpoint was written at; any >= V is fine.
    stored = weights.tensors.get("embedding.word_embeddings.weight") if hf_base is None else None
    stored_rows = stored[0][0] if stored is not None else dims.vocab_size
    units = adapter.weight_units(cfg, padded_vocab_size=max(stored_rows, dims.vocab_size))
    _check_mcore_tensors(reader, units, dims, cfg_dir / "config.json", lora, weights=base_dir is None)
    if weights is not reader:
        _check_mcore_tensors(weights, units, dims, cfg_dir / "config.json", None)
    elif hf_base is not None:
        _check_hf_tensors(hf_base, units, adapter, cfg)
    adapted = {id(u) for u in adapted_units(units, lora)} if lora is not None else set()

    def native(unit: WeightUnit) -> torch.dtype:
        return hf_base.entries[unit.hf_names[0]].dtype if hf_base is not None else weights.tensors[unit.sharded_key][1]

    specs = []
    for unit in units if write_model else ():
        dtype = _target_dtype(options.dtype, native(unit))
        specs += [TensorSpec(name=n, shape=tuple(s), dtype=dtype) for n, s in zip(unit.hf_names, unit.hf_shapes)]
    dtype_of = {s.name: s.dtype for s in specs}
    # The model: its units in reading groups; the adapters alone: each adapted unit by itself.
    if not write_model:
        batches = [[u] for u in units if id(u) in adapted]
    elif hf_base is not None:
        batches = [[u] for u in units]
    else:
        batches = list(_read_batches(units, weights))

    def read_weights(batch: list[WeightUnit]) -> list[torch.Tensor]:
        if not write_model:
            return [None] * len(batch)
        if hf_base is not None:
            return [adapter.hf_to_mcore(u, {n: hf_base.read(n) for n in u.hf_names}) for u in batch]
        return weights.read_many([(u.sharded_key, u.layer, u.expert) for u in batch])

    needed = sum(spec.nbytes for spec in specs)
    peft: dict[str, torch.Tensor] = {}
    with contextlib.ExitStack() as outputs, single_process_group():
        tmp = outputs.enter_context(_atomic_output_dir(options.out_dir, needed_bytes=needed)) if write_model else None
        peft_tmp = outputs.enter_context(_atomic_output_dir(options.peft_dir)) if options.peft_dir else None
        writer = SafetensorsShardWriter(tmp, specs, max_shard_bytes=options.max_shard_bytes) if tmp else None
        try:
            for batch in batches:
                tensors = read_weights(batch)
                requests = [(key, u.layer, None) for u in batch if id(u) in adapted for key in adapter_keys(u)]
                pairs = iter(reader.read_many(requests) if requests else ())
                for unit, full in zip(batch, tensors):
                    if id(unit) in adapted:
                        a, b = next(pairs), next(pairs)
                        if peft_tmp is not None:
                            peft.update(peft_tensors(unit, a, b, lora))
                        if full is not None:
                            full = merge_adapter(unit, full, a, b, lora)
                    if writer is not None:
                        for name, tensor in adapter.mcore_to_hf(unit, full):
                            writer.write(name, tensor.to(dtype_of[name]))
                del tensors, full
            if writer is not None:
                writer.finish()
        finally:
            if writer is not None:
                writer.close()
        if peft_tmp is not None:
            write_peft_adapter(peft_tmp, {k: v.to(_target_dtype(options.dtype, v.dtype)) for k, v in peft.items()},
                               lora, cfg)  # fmt: skip
        if tmp is not None:
            # config.json is copied verbatim unless a cast changes the dtype it records.
            copy_aux_files(cfg_dir, tmp, skip=["config.json"] if options.dtype is not None else [])
            if options.dtype is not None:
                name = str(dtype_from_name(options.dtype)).removeprefix("torch.")
                keys = [k for k in ("dtype", "torch_dtype") if k in cfg] or ["torch_dtype"]
                cfg.update({k: name for k in keys})
                (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return ConversionSummary(
        out_dir=Path(options.out_dir if write_model else options.peft_dir).absolute(),
        model_type=dims.model_type,
        num_tensors=len(specs) if write_model else len(peft),
        tensor_bytes=writer.bytes_written if writer is not None else sum(t.nbytes for t in peft.values()),
        seconds=time.perf_counter() - start,
    )
