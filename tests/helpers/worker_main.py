"""The torchrun entry shared by the actor test workers (``actor_worker.py``,
``actor_scale_worker.py``, ``packing_worker.py``).

``python tests/helpers/fork_ranks.py N WORKER.py SPEC.json OUT_DIR`` (the tests) or
``python -m torch.distributed.run ... WORKER.py SPEC.json OUT_DIR``: every rank joins a gloo
world, runs the worker's checks and writes ``OUT_DIR/rank<r>.json``. Megatron is imported
inside the call only: the dist-checkpoint writer starts ``spawn`` helper processes that
re-import the worker file.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path


def run_worker(run: Callable[[dict, Path], dict]) -> None:
    """Run ``run(spec, out_dir)`` on this rank and write its report (plus the total seconds)."""
    import torch.distributed as dist

    from megatron_rl.actor.launch import destroy_process_groups, init_process_group

    spec = json.loads(Path(sys.argv[1]).read_text())
    out_dir = Path(sys.argv[2])
    init_process_group(backend="gloo")
    start = time.perf_counter()
    report = run(spec, out_dir)
    report.setdefault("timing_s", {})["total"] = time.perf_counter() - start
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(report, indent=2, default=str))
    destroy_process_groups()
