"""Run a function on N gloo ranks (CPU) and collect what rank 0 reports.

Workers are module-level functions ``fn(rank, world, results, *args)``; ``results`` is a
shared list. Each run rendezvouses through a file store of its own (no TCP port to pick:
one picked as free can be taken by another process before the store binds it, as when CI
runs two test sessions side by side), so tests can run back to back and side by side.

Ranks are forked by this pytest process's forkserver, which imports the test ranks'
modules once (``tests/helpers/fork_ranks.py``'s ``PRELOAD``): a rank started with ``spawn``
imported torch and megatron-core again (~3 CPU-s each on the CI machine's 2 cores, more than
most of these tests' own work). The forkserver is a fresh process (no Ray, no torch threads
of the test process), and it runs no torch op, so a rank inherits nothing half-made. The
server starts at this process's first :func:`start_ranks`, and a rank sees the environment
variables and working directory it started with, not those of the calling test: pass what
a rank needs as arguments.
"""

import multiprocessing
import os
import tempfile

import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers.fork_ranks import PRELOAD


def file_store_url(directory: str) -> str:
    """A ``file://`` rendezvous in ``directory`` (which must outlive the group)."""
    return "file://" + os.path.join(directory, "rendezvous")


def start_ranks(entry, args: tuple, nprocs: int) -> None:
    """``torch.multiprocessing.spawn(entry, args, nprocs)``, the ranks forked by the forkserver."""
    multiprocessing.set_forkserver_preload(list(PRELOAD))  # no effect once the server runs: the same list
    mp.start_processes(entry, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def _entry(rank, world, store_url, fn, results, args):
    dist.init_process_group("gloo", init_method=store_url, rank=rank, world_size=world)
    try:
        fn(rank, world, results, *args)
    finally:
        dist.destroy_process_group()


def run_on_ranks(fn, world: int, *args) -> list:
    """Start ``world`` gloo ranks running ``fn``; return the shared results list."""
    with mp.Manager() as manager, tempfile.TemporaryDirectory() as rendezvous:
        results = manager.list()
        start_ranks(_entry, (world, file_store_url(rendezvous), fn, results, args), world)
        return list(results)
