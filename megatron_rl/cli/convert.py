"""``megatron-rl convert``: HF safetensors <-> megatron-core dist-checkpoints, streaming.

::

    megatron-rl convert hf-to-mcore --hf /ckpt/Qwen2.5-7B-Instruct --out /ckpt/q7b-mcore --tp 4 --pp 1
    megatron-rl convert hf-to-mcore --hf /ckpt/Qwen3-30B-A3B --out /ckpt/q30b-mcore --tp 2 --ep 8
    megatron-rl convert mcore-to-hf --mcore /ckpt/q7b-mcore --out /ckpt/q7b-hf [--hf-config DIR]
    megatron-rl convert mcore-to-hf --mcore RUN/checkpoints/step_000100 --out merged/ --peft-out adapter/

The command line over :mod:`megatron_rl.models.convert.hf_mcore` (which the module doc there
explains: layouts, streaming, atomic output). ``--tp`` only chooses the vocabulary padding
and, with ``--pp``, ``--ep`` and ``--etp``, what the model's head, group, layer and expert
counts and expert width are checked against: the checkpoint loads at any TP/PP/EP/ETP. A
LoRA run's checkpoint converts with its adapters merged into the weights (``--out``) and/or
as a PEFT adapter (``--peft-out``), from the settings its ``actor_state.json`` records.
``tools/convert_hf_to_mcore.py`` and ``tools/convert_mcore_to_hf.py`` reuse the argument
helpers here. Bad input is exit code 1 with ``error: ...`` (naming the file and tensor) on
stderr, and so is a full disk (the partial output is removed); a
:class:`~megatron_rl.models.convert.hf_mcore.ConversionWarning` (e.g. no tokenizer files to
keep) is one ``warning: ...`` line.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from megatron_rl.cli import EXIT_FAILURE, EXIT_OK

__all__ = ["add_arguments", "add_hf_to_mcore_arguments", "add_mcore_to_hf_arguments", "main", "parse_size", "recorded_lora", "run"]


def parse_size(text: str) -> int:
    """``5GB`` / ``500MB`` / ``64KiB`` / ``1000`` -> bytes (KB/MB/GB are powers of 10, like HF)."""
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    upper = text.strip().upper()
    for suffix, factor in units.items():
        if upper.endswith(suffix):
            number = upper[: -len(suffix)].strip()
            break
    else:
        number, factor = upper, 1
    try:
        value = int(float(number) * factor)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid size {text!r} (examples: 5GB, 500MB, 64KiB, 1000)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return value


def add_hf_to_mcore_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``hf-to-mcore`` (also used by tools/convert_hf_to_mcore.py)."""
    parser.add_argument("--hf", required=True, type=Path, help="HF model directory (config.json + *.safetensors)")
    parser.add_argument("--out", required=True, type=Path, help="output directory (must not exist or be empty)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size to pad the vocabulary for (default 1)")
    parser.add_argument(
        "--pp", type=int, default=1, help="pipeline-parallel size to check the layer count against (default 1)"
    )
    parser.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel size to check the number of experts against (mixture-of-experts models; default 1)",
    )
    parser.add_argument(
        "--etp",
        type=int,
        default=None,
        help="expert tensor-parallel size to check the expert width against (mixture-of-experts models; "
        "default: --tp)",
    )
    parser.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="pad embedding rows to a multiple of this times --tp (default 128)",
    )
    parser.add_argument(
        "--dtype", choices=["bf16", "fp16", "fp32"], default=None, help="cast all tensors (default: keep)"
    )


def add_mcore_to_hf_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``mcore-to-hf`` (also used by tools/convert_mcore_to_hf.py)."""
    parser.add_argument("--mcore", required=True, type=Path, help="megatron-core torch_dist checkpoint directory")
    parser.add_argument(
        "--out", type=Path, default=None,
        help="output directory of the HF model, a LoRA checkpoint's adapters merged (must not exist or be empty; "
        "optional with --peft-out)",
    )  # fmt: skip
    parser.add_argument(
        "--peft-out", type=Path, default=None,
        help="output directory of a LoRA checkpoint's adapters in PEFT's format (adapter_config.json + "
        "adapter_model.safetensors; must not exist or be empty)",
    )  # fmt: skip
    parser.add_argument(
        "--hf-config",
        type=Path,
        default=None,
        help="directory with config.json and tokenizer files (default: <mcore>/hf_config, "
        "where hf-to-mcore keeps them)",
    )
    parser.add_argument(
        "--max-shard-size",
        type=parse_size,
        default=5 * 10**9,
        help="largest safetensors shard, e.g. 5GB (default), 500MB",
    )
    parser.add_argument(
        "--dtype", choices=["bf16", "fp16", "fp32"], default=None, help="cast all tensors (default: keep)"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``hf-to-mcore`` / ``mcore-to-hf`` sub-commands to ``parser`` (dest ``convert_direction``)."""
    sub = parser.add_subparsers(dest="convert_direction", required=True, metavar="{hf-to-mcore,mcore-to-hf}")
    add_hf_to_mcore_arguments(sub.add_parser("hf-to-mcore", help="HF safetensors -> Megatron dist-checkpoint"))
    add_mcore_to_hf_arguments(sub.add_parser("mcore-to-hf", help="Megatron dist-checkpoint -> HF safetensors"))


def run(args: argparse.Namespace) -> int:
    """Run the parsed command; returns the exit code (1 with a message on stderr for bad input)."""
    # Imported here: the conversion library imports torch, which ``--help`` does not need.
    from megatron_rl.models.convert.hf_mcore import ConversionWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConversionWarning)
        code, summary = _convert(args)
    for w in caught:
        if issubclass(w.category, ConversionWarning):
            print(f"warning: {w.message}", file=sys.stderr)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if summary is None:
        return code
    print(
        f"{args.convert_direction}: wrote {summary.num_tensors} tensors ({summary.tensor_bytes / 2**30:.2f} GiB) "
        f"of a {summary.model_type} model to {summary.out_dir} in {summary.seconds:.1f} s"
    )
    if getattr(args, "peft_out", None) is not None and getattr(args, "out", None) is not None:
        print(f"{args.convert_direction}: wrote the LoRA adapters in PEFT's format to {args.peft_out.absolute()}")
    return EXIT_OK


def _convert(args: argparse.Namespace):
    """``(exit code, summary or None)`` of the conversion ``args`` asks for."""
    from megatron_rl.models.convert.hf_mcore import (
        ConversionError,
        HfToMcoreOptions,
        McoreToHfOptions,
        hf_to_mcore,
        mcore_to_hf,
    )

    try:
        if args.convert_direction == "hf-to-mcore":
            summary = hf_to_mcore(
                HfToMcoreOptions(
                    hf_dir=args.hf,
                    out_dir=args.out,
                    tp=args.tp,
                    pp=args.pp,
                    ep=args.ep,
                    etp=args.etp,
                    make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                    dtype=args.dtype,
                )
            )
        elif args.convert_direction == "mcore-to-hf":
            summary = mcore_to_hf(
                McoreToHfOptions(
                    mcore_dir=args.mcore,
                    out_dir=args.out,
                    peft_dir=args.peft_out,
                    lora=recorded_lora(args.mcore, need_base=args.out is not None),
                    hf_config_dir=args.hf_config,
                    max_shard_bytes=args.max_shard_size,
                    dtype=args.dtype,
                )
            )
        else:
            raise ValueError(f"unknown direction {args.convert_direction!r}")
    except (ConversionError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAILURE, None
    return EXIT_OK, summary


def recorded_lora(mcore_dir: Path, *, need_base: bool = False):
    """The LoRA adapters a training checkpoint records in its ``actor_state.json`` (None: none,
    or a converted checkpoint without the file). ``need_base``: an adapter-only checkpoint's
    base weights must be where it says, with the fingerprint it records."""
    import json

    from megatron_rl.models.convert.lora_export import LoRAExport
    from megatron_rl.models.weight_units import ConversionError
    from megatron_rl.storage.checkpoints import BASE_WEIGHTS_KEY, STATE_FILE, CheckpointError, verify_base_weights

    path = Path(mcore_dir) / STATE_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        lora, base = record.get("lora"), record.get(BASE_WEIGHTS_KEY)
        if lora is None:
            return None
        export = LoRAExport(rank=int(lora["rank"]), alpha=float(lora["alpha"]), target_modules=tuple(lora["target_modules"]),
                            base_dir=None if base is None else Path(base["path"]))  # fmt: skip
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConversionError(f"{path}: cannot read its 'lora' record: {type(e).__name__}: {e}") from None
    if need_base:
        try:
            verify_base_weights(mcore_dir)
        except CheckpointError as e:
            raise ConversionError(f"checkpoint {e}") from None
    return export


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point: ``python -m megatron_rl.cli.convert hf-to-mcore ...``."""
    parser = argparse.ArgumentParser(prog="megatron-rl convert", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
