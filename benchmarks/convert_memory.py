"""Peak memory of checkpoint conversion on a synthetic multi-GB model; prints one JSON line.

    python benchmarks/convert_memory.py                      # ~3.7 GB bf16 Qwen2-style model
    python benchmarks/convert_memory.py --layers 4 --vocab 32000   # quicker

Steps: (1) write a random Qwen2-style HF checkpoint straight to safetensors, tensor by
tensor (the model is never instantiated); (2) ``hf-to-mcore`` and (3) ``mcore-to-hf``,
each in a fresh child process that reports its own peak RSS (``VmHWM``, which
includes file pages mapped by safetensors); (4) check the round trip is bit-exact,
tensor by tensor. Two more children measure each direction's import baseline (torch,
torch DCP, safetensors, megatron_rl.models.convert.hf_mcore; plus megatron-core's dist-checkpointing for
mcore-to-hf), which a conversion pays before reading a byte. The claim under test:
peak RSS ~ baseline + a small multiple of the largest tensor, far below the
checkpoint size.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def _peak_rss_bytes() -> int:
    """This process's peak RSS: VmHWM of /proc/self/status (Linux).

    Not ``getrusage().ru_maxrss``: Linux carries that over from the parent through
    fork + exec, so a child would report the parent's peak (measured here: the synthetic
    checkpoint writer's 2.7 GB showed up in every child).
    """
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024  # kB
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def _child(args: argparse.Namespace) -> None:
    """Run one measured step in this (fresh) process and print its JSON result."""
    start = time.perf_counter()
    from megatron_rl.models.convert import hf_mcore as convert

    if args.child == "baseline-hf-to-mcore":
        import safetensors  # noqa: F401
        import torch.distributed.checkpoint  # noqa: F401
    elif args.child == "baseline-mcore-to-hf":
        import megatron.core.dist_checkpointing  # noqa: F401
        import safetensors  # noqa: F401
    elif args.child == "hf-to-mcore":
        convert.hf_to_mcore(convert.HfToMcoreOptions(hf_dir=args.work / "hf", out_dir=args.work / "mcore"))
    elif args.child == "mcore-to-hf":
        convert.mcore_to_hf(convert.McoreToHfOptions(mcore_dir=args.work / "mcore", out_dir=args.work / "hf_back"))
    print(json.dumps({"peak_rss_bytes": _peak_rss_bytes(), "seconds": round(time.perf_counter() - start, 2)}))


def _run_child(step: str, work: Path) -> dict:
    cmd = [sys.executable, __file__, "--child", step, "--work", str(work)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{step} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _write_synthetic_hf(directory: Path, cfg: dict, dtype: torch.dtype, max_shard_bytes: int) -> tuple[int, int]:
    """Random weights for every tensor the adapter expects; returns (total bytes, largest tensor bytes)."""
    from megatron_rl.models import get_adapter, padded_vocab_size
    from megatron_rl.models.hf_io import SafetensorsShardWriter, TensorSpec

    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    adapter = get_adapter(cfg["model_type"])
    units = adapter.weight_units(cfg, padded_vocab_size=padded_vocab_size(cfg["vocab_size"], tp_size=1))
    specs = [TensorSpec(name=n, shape=tuple(s), dtype=dtype) for u in units for n, s in zip(u.hf_names, u.hf_shapes)]
    writer = SafetensorsShardWriter(directory, specs, max_shard_bytes=max_shard_bytes)
    generator = torch.Generator().manual_seed(0)
    for spec in specs:
        writer.write(spec.name, (0.02 * torch.randn(spec.shape, generator=generator)).to(dtype))
    writer.finish()
    return writer.bytes_written, max(s.nbytes for s in specs)


def _round_trip_equal(a: Path, b: Path) -> bool:
    from megatron_rl.models.hf_io import SafetensorsReader

    left, right = SafetensorsReader.open(a), SafetensorsReader.open(b)
    if sorted(left.entries) != sorted(right.entries):
        return False
    return all(torch.equal(left.read(name), right.read(name)) for name in left.entries)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=11008)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--max-shard-size-gb", type=float, default=2.0, help="shard size of the synthetic HF input")
    parser.add_argument("--work", type=Path, default=None, help="scratch directory (default: a temp dir, removed)")
    parser.add_argument("--child", choices=["baseline-hf-to-mcore", "baseline-mcore-to-hf", "hf-to-mcore", "mcore-to-hf"], default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return

    work = args.work or Path(tempfile.mkdtemp(prefix="convert_memory_"))
    cfg = {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "vocab_size": args.vocab,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16" if args.dtype == "bf16" else "float32",
    }
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    try:
        start = time.perf_counter()
        ckpt_bytes, largest = _write_synthetic_hf(work / "hf", cfg, dtype, int(args.max_shard_size_gb * 1e9))
        write_seconds = time.perf_counter() - start
        to_mcore = _run_child("hf-to-mcore", work) | {"import_baseline_rss_bytes": _run_child("baseline-hf-to-mcore", work)["peak_rss_bytes"]}
        to_hf = _run_child("mcore-to-hf", work) | {"import_baseline_rss_bytes": _run_child("baseline-mcore-to-hf", work)["peak_rss_bytes"]}
        equal = _round_trip_equal(work / "hf", work / "hf_back")
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({
        "benchmark": "convert_memory",
        "model": {k: cfg[k] for k in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                                      "num_attention_heads", "num_key_value_heads", "vocab_size")} | {"dtype": args.dtype},
        "checkpoint_bytes": ckpt_bytes,
        "largest_tensor_bytes": largest,
        "synthetic_write_seconds": round(write_seconds, 1),
        "hf_to_mcore": to_mcore,
        "mcore_to_hf": to_hf,
        "round_trip_bit_exact": equal,
    }))


if __name__ == "__main__":
    main()
