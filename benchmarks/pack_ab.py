"""Packed vs padded micro-batches on ``benchmarks/vs_trl.py``'s workload (``megatron-rl
train`` only, the same config but ``trainer.pack_sequences``), the modes alternated so
both see the same machine state. Prints one JSON line per run: the medians of the
trainer's ``timing_s/*`` metrics over steps 4..N.

    python benchmarks/pack_ab.py [--steps 30] [--rounds 2] [--idle-load 0.8]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import vs_trl  # noqa: E402  (the workload, its config and the idle wait)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--idle-load", type=float, default=0.8)
    args = parser.parse_args()

    from megatron_rl.observability import read_metrics

    skip = 3  # as vs_trl.py: steps 4..N
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        vs_trl._tokenizer(work / "tok", vs_trl.VOCAB)
        vs_trl._data(work / "train.jsonl", 512, vs_trl.VOCAB)
        vs_trl._model(work / "model", args.seed)
        for round_ in range(args.rounds):
            for mode in ("packed", "padded"):
                load = vs_trl.wait_idle(args.idle_load, 300.0)
                cfg = vs_trl._ours_config(work, work / "model", args.steps, args.seed)
                pack = f"trainer.pack_sequences={'true' if mode == 'packed' else 'false'}"
                subprocess.run([sys.executable, "-m", "megatron_rl", "train", str(cfg), pack], check=True,
                               capture_output=True)  # fmt: skip
                run_dir = work / "runs" / f"ours_seed{args.seed}"
                records = read_metrics(run_dir)[skip:]
                timing = {
                    k: statistics.median(r[k] for r in records) for k in sorted(records[0]) if k.startswith("timing_s/")
                }
                print(json.dumps({"bench": "pack_ab", "mode": mode, "round": round_, "steps": args.steps,
                                  "cpu": vs_trl.cpu_model(), "load_before": load, **timing}), flush=True)  # fmt: skip
                shutil.rmtree(run_dir)


if __name__ == "__main__":
    main()
