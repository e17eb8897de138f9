"""Run a function on N gloo ranks (CPU) and collect what rank 0 reports.

Workers are module-level functions ``fn(rank, world, results, *args)``; ``results`` is a
shared list. Each run rendezvouses through a file store of its own (no TCP port to pick:
one picked as free can be taken by another process before the store binds it, as when CI
runs two test sessions side by side), so tests can run back to back and side by side.
"""

import os
import tempfile

import torch.distributed as dist
import torch.multiprocessing as mp


def file_store_url(directory: str) -> str:
    """A ``file://`` rendezvous in ``directory`` (which must outlive the group)."""
    return "file://" + os.path.join(directory, "rendezvous")


def _entry(rank, world, store_url, fn, results, args):
    dist.init_process_group("gloo", init_method=store_url, rank=rank, world_size=world)
    try:
        fn(rank, world, results, *args)
    finally:
        dist.destroy_process_group()


def run_on_ranks(fn, world: int, *args) -> list:
    """Spawn ``world`` gloo ranks running ``fn``; return the shared results list."""
    with mp.Manager() as manager, tempfile.TemporaryDirectory() as rendezvous:
        results = manager.list()
        mp.spawn(_entry, args=(world, file_store_url(rendezvous), fn, results, args), nprocs=world, join=True)
        return list(results)
