#!/usr/bin/env python
"""Peak memory of the actor's side of one weight sync, measured per rank (JSON lines).

    python benchmarks/sync_memory.py                  # the default case (TP 2 x PP 2, 4 ranks)
    python benchmarks/sync_memory.py --case JSON      # one case (keys of DEFAULT_CASE)

The actor's ranks (a ``PolicyModel``, float32, Qwen2-shaped, under torchrun) run the
sync's sender side for real: ``HFWeightSource`` (full tensors gathered on global rank 0
only) into the project's ``GlooSender`` (the collective transport on CPU), packed in
chunks of the bucket size and broadcast to one receiver process, which receives and
drops them. Each rank samples its resident memory (``/proc/self/statm``, every half
millisecond, glibc's mmap threshold fixed so freed tensors leave the process at once)
during ``send_weights`` and reports the peak above what it held just before.
``tests/distributed/test_planner.py`` compares rank 0's figure with the planner's
``sync_transient_bytes``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from actor_memory import PeakRSS, hf_config, launch_case  # noqa: E402

DEFAULT_CASE = {
    "hidden": 1024, "ffn": 2816, "layers": 2, "heads": 16, "kv_heads": 4, "vocab": 32000, "tie": False,
    "tp": 2, "pp": 2, "dtype": "float32", "bucket_mb": 32,
}  # fmt: skip


def _receiver(conn) -> None:
    """The engine's side: join the group, receive every version, drop the chunks."""
    from megatron_rl.weight_sync.transports.gloo import GlooInitInfo, GlooReceiver

    receiver = None
    while True:
        kind, payload = conn.recv()
        if kind == "init":
            receiver = GlooReceiver(GlooInitInfo(**payload), worker_rank=0)
            conn.send("ok")
        elif kind == "update":
            receiver.receive(payload, load=lambda chunk: None)
            conn.send("ok")
        else:
            return


class _PipeClient:
    """The weight-sync client of the receiver process (what the pool's client is to engines)."""

    world_size = 2

    def __init__(self, conn):
        self.conn = conn

    def _call(self, kind, payload) -> None:
        self.conn.send((kind, payload))
        if self.conn.recv() != "ok":
            raise RuntimeError(f"receiver failed on {kind}")

    def init_weight_transfer_engine(self, init_info) -> None:
        self._call("init", init_info)

    def start_weight_update(self) -> None:
        pass

    def update_weights(self, update_info) -> None:
        self._call("update", update_info)

    def finish_weight_update(self) -> None:
        pass


def run_case(case: dict) -> dict | None:
    """Build the policy, run one sync, measure; rank 0's report (``None`` elsewhere)."""
    import torch
    import torch.distributed as dist

    from megatron_rl.actor.launch import destroy_process_groups, init_process_group, initialize_parallel
    from megatron_rl.actor.policy import PolicyModel
    from megatron_rl.actor.spec import ActorSpec
    from megatron_rl.config.model import ModelOptions
    from megatron_rl.config.parallel import ParallelConfig
    from megatron_rl.weight_sync.transports.gloo import GlooInitInfo, GlooSender, free_port

    init_process_group()
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = initialize_parallel(tensor_model_parallel_size=case["tp"], pipeline_model_parallel_size=case["pp"])
    spec = ActorSpec(
        architecture=hf_config(case), model=ModelOptions(dtype=case["dtype"]),
        parallel=ParallelConfig(num_actor_ranks=world, tensor_model_parallel_size=case["tp"],
                                pipeline_model_parallel_size=case["pp"]),
    )  # fmt: skip
    policy = PolicyModel(spec, groups=groups)
    source = policy.weight_source(dtype=getattr(torch, case["dtype"]))
    conn = process = None
    if rank == 0:
        conn, child = mp.get_context("spawn").Pipe()
        process = mp.get_context("spawn").Process(target=_receiver, args=(child,), daemon=True)
        process.start()
        info = GlooInitInfo(master_address="127.0.0.1", master_port=free_port(), world_size=2,
                            chunk_bytes=case["bucket_mb"] << 20)  # fmt: skip
        sender = GlooSender.trainer_init(info, client=_PipeClient(conn), source=source)
    else:
        sender = GlooSender.trainer_init(GlooInitInfo(master_address="", master_port=0, world_size=2),
                                         client=None, source=source, is_sender=False)  # fmt: skip
    dist.barrier()
    probe = PeakRSS()
    before = probe.rss()
    with probe:
        sender.send_weights()
    mine = probe.peak - before
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    if conn is not None:
        conn.send(("stop", None))
        process.join(timeout=30)
    destroy_process_groups()
    if rank != 0:
        return None
    return {
        "benchmark": "sync_memory",
        "case": case,
        "world": world,
        "sync_peak_bytes_per_rank": everyone,
        "sender_sync_peak_bytes": everyone[0],
    }


def launch(case: dict, *, timeout_s: float = 900, ranks_launcher: list[str] | None = None) -> dict:
    """Run ``case`` in fresh processes (torchrun unless ``ranks_launcher``: see
    ``actor_memory.launch_case``); rank 0's report."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    return launch_case(Path(__file__), case, world=case["tp"] * case["pp"], benchmark="sync_memory",
                       timeout_s=timeout_s, env=env, ranks_launcher=ranks_launcher)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", help="run one case (JSON of DEFAULT_CASE's keys) in this process (under torchrun)")
    args = parser.parse_args(argv)
    if args.case:
        report = run_case({**DEFAULT_CASE, **json.loads(args.case)})
        if report is not None:
            print(json.dumps(report), flush=True)
        return 0
    print(json.dumps(launch(dict(DEFAULT_CASE))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
