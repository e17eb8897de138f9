"""What a CPU vLLM engine's start costs with its worker in the engine's process (``uni``,
what a pool's Ray actor builds: ``own_process``) and in a child process (``mp``).

Each case runs in a fresh process, alternating: import vLLM, build a ``VLLMEngine`` over
the vLLM tests' 2-layer float32 Qwen2 (``tests/helpers/rollout_models.py``), generate one
prompt (8 tokens, seeded), shut it down. Reported: the process's wall time, its CPU
seconds with every child it waited for (vLLM's worker included), the start's own wall
time (build + generate), and the tokens (equal across cases: the same engine output).

    PYTHONPATH=$PWD python benchmarks/vllm_engine_start.py --repeats 2

One JSON line per run and a ``ratio`` line (medians, ``mp`` / ``uni``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = """
import json, os, sys, time
sys.path.insert(0, {root!r})
from megatron_rl.rollout.engines.vllm import VLLMEngine
from megatron_rl.rollout.engines.sampling import SamplingParams
from tests.helpers.rollout_models import vllm_engine_args

start = time.monotonic()
engine = VLLMEngine({model!r}, name="bench", own_process={own}, **vllm_engine_args())
out = engine.generate([[1, 2, 3]], SamplingParams(n=1, temperature=1.0, max_new_tokens=8, seed=1), prompt_seeds=[1])
start_s = time.monotonic() - start
backend = engine.health()["distributed_executor_backend"]
engine.shutdown()
print(json.dumps({{"start_s": round(start_s, 2), "backend": backend, "tokens": out[0][0].token_ids}}))
"""


def run_case(model: str, own_process: bool) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", CHILD.format(root=ROOT, model=model, own=own_process)],
                          capture_output=True, text=True, check=True, cwd=ROOT)  # fmt: skip
    wall_s = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"case": "uni" if own_process else "mp", "process_wall_s": round(wall_s, 2), "cpu_s": round(cpu_s, 2),
            **result}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    sys.path.insert(0, ROOT)
    from tests.helpers.rollout_models import VLLM_MODEL, save_qwen2

    model = str(save_qwen2(os.path.join(tempfile.mkdtemp(), "model"), seed=5, **VLLM_MODEL))
    runs: dict[str, list[dict]] = {"mp": [], "uni": []}
    for _ in range(args.repeats):
        for own_process in (False, True):
            row = run_case(model, own_process)
            runs[row["case"]].append(row)
            print(json.dumps(row), flush=True)
    tokens = {json.dumps(r["tokens"]) for rows in runs.values() for r in rows}
    med = {case: {k: statistics.median(r[k] for r in rows) for k in ("cpu_s", "start_s", "process_wall_s")}
           for case, rows in runs.items()}  # fmt: skip
    print(json.dumps({"ratio": "mp/uni", **{k: round(med["mp"][k] / med["uni"][k], 2) for k in med["mp"]},
                      "same_tokens": len(tokens) == 1}))  # fmt: skip


if __name__ == "__main__":
    main()
