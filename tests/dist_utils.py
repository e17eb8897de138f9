"""Run a function on N gloo ranks (CPU) and collect what rank 0 reports.

Workers are module-level functions ``fn(rank, world, results, *args)``; ``results`` is a
shared list. Each run gets its own free port, so tests can run back to back.
"""

import os
import socket

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, fn, results, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, results, *args)
    finally:
        dist.destroy_process_group()


def run_on_ranks(fn, world: int, *args) -> list:
    """Spawn ``world`` gloo ranks running ``fn``; return the shared results list."""
    with mp.Manager() as manager:
        results = manager.list()
        mp.spawn(_entry, args=(world, free_port(), fn, results, args), nprocs=world, join=True)
        return list(results)
