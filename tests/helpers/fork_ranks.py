"""Run a torchrun worker script on N ranks forked from one process that has already
imported what every rank imports.

    python tests/helpers/fork_ranks.py N WORKER.py [ARGS ...]

A rank started by torchrun is a new interpreter that imports torch, megatron-core and the
actor again: ~5 CPU-s per rank on the CI machine's 2 cores, more than many of the test
jobs' own work. Here this process imports them once (:data:`PRELOAD`) and forks the
ranks, which share the imported modules.

Each rank gets what ``torchrun --standalone`` gives a worker: ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` / ``MASTER_PORT`` of a TCP store this
process hosts (on a port the OS assigned when the store bound it, so no other process can
take it first) with ``TORCHELASTIC_USE_AGENT_STORE=True`` (every rank joins the store as a
client, as torchrun's ranks join its agent's), and ``OMP_NUM_THREADS=1`` unless it is set.
``WORKER.py`` runs as ``__main__`` with ``sys.argv = [WORKER.py, *ARGS]`` and its directory
first on ``sys.path``, so ``spawn`` children it starts (megatron's checkpoint writer)
re-import it as under torchrun. As torchrun does, the first rank that fails ends the
others and its exit code is the job's.

Why forking is safe here: this process runs no torch operation before it forks (imports
only; the store starts after the fork), so there is no OpenMP pool or store thread whose
state a rank could inherit half-made.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys

PRELOAD = ("torch", "torch.distributed", "megatron.core", "megatron_rl.actor.actor", "megatron_rl.actor.launch",
           "transformers.modeling_utils", "transformers.models.auto.modeling_auto")
"""Modules the test ranks import (these jobs' and ``tests/dist_utils.py``'s forkserver's;
most compare with transformers). Importing them patches nothing: ``cpu_shim.apply`` runs in
``initialize_parallel``."""


def _run_rank(worker: str, args: list[str], env: dict[str, str], port_fd: int) -> int:
    """The forked rank: wait for the store's port, then run ``worker``; its exit code."""
    import atexit
    import ctypes
    import runpy
    import traceback

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the launcher
    with os.fdopen(port_fd) as f:
        port = f.read().strip()
    if not port:  # the launcher failed before it could host the store
        return 1
    os.environ.update(env, MASTER_PORT=port)
    sys.argv = [worker, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(worker)))
    try:
        runpy.run_path(worker, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # what an interpreter's normal exit runs (the rank leaves by os._exit)
    return code


def main(argv: list[str]) -> int:
    if len(argv) < 2 or not argv[0].isdigit() or int(argv[0]) < 1:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    nproc, worker, args = int(argv[0]), argv[1], argv[2:]
    if nproc > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default, read when torch loads
    for name in PRELOAD:
        importlib.import_module(name)
    if "OMP_NUM_THREADS" in os.environ:
        # A libgomp preloaded into this process (LD_PRELOAD, as vLLM's CPU set-up writes it)
        # read the variable when the process started, before the line above set it, and would
        # run a thread per core in every rank. Setting no pool up, this is safe before a fork.
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

    ranks: set[int] = set()  # the pids of the ranks still running
    ports = []
    for rank in range(nproc):
        read_fd, write_fd = os.pipe()
        env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
               "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
               "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0"}  # fmt: skip
        pid = os.fork()
        if pid == 0:
            os.close(write_fd)
            for fd in ports:
                os.close(fd)
            code = 1
            try:
                code = _run_rank(worker, args, env, read_fd)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        os.close(read_fd)
        ranks.add(pid)
        ports.append(write_fd)

    from datetime import timedelta

    import torch.distributed as dist

    try:  # the ranks' store: up once every rank is forked, alive until they have all ended
        store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(minutes=30), wait_for_workers=False)
        for fd in ports:
            os.write(fd, f"{store.port}\n".encode())
    finally:
        for fd in ports:  # a rank that read no port exits 1
            os.close(fd)
    code = 0
    while ranks:
        pid, status = os.wait()
        ranks.discard(pid)
        rank_code = os.waitstatus_to_exitcode(status)
        if rank_code != 0 and code == 0:
            code = rank_code if rank_code > 0 else 128 - rank_code  # killed by signal N: 128 + N
            for other in ranks:
                try:
                    os.kill(other, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
