"""CPU seconds of a machine's processes by kind, while a command runs (what CI spends its cores on).

    python tools/cpu_by_process.py --out cpu.json -- bash .ci/run

Every ``--interval-s`` it reads each process's user + system time (``/proc/PID/stat``, the
process's own, not its children's: each process is counted once) and its command line, which
names its kind (``KINDS``: a Ray actor by its class, a torchrun rank by its script, the ranks
of ``tests/helpers/fork_ranks.py`` and their launcher by theirs, a CLI run, Ray's own
daemons, ...). A process's last reading counts when it exits, so one that lives less than an
interval is missed: the machine's whole CPU time over the same span (``/proc/stat``)
is printed beside the sum, and the difference as ``unsampled``. ``--tree`` counts only the
command's own process tree (a process whose parent, when first seen, is in it), so a
measurement is not mixed with whatever else the machine runs. Prints one JSON line per kind,
largest first, and the total; ``--out`` keeps them. The command's exit status is returned.

``--by-test FILE`` also charges each interval's CPU to the pytest test that caused it, and
writes one JSON line per test to FILE (largest first): the command's pytest processes load
``tools/cpu_test_plugin.py`` (through ``PYTEST_PLUGINS``), which keeps the test each
worker runs in a file and names the worker in the environment of every process a test
starts (and so of their children: a Ray cluster's daemons and actors, a CLI run's whole
tree, torchrun's ranks). A process's CPU over an interval goes to the test its worker runs
at the interval's end, so a worker's long-lived processes (a shared Ray cluster, kept
actors) are charged to the tests they serve; a megatron-core matrix run's tests carry a
``matrix:`` prefix.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

_KIND_PATTERNS = r"""
ray idle worker         ^ray::IDLE
ray actor               ^ray::(\w+)
ray daemons             raylet|gcs_server|dashboard|log_monitor|runtime_env|ray/_private|monitor\.py
forked ranks            tests/helpers/fork_ranks\.py \d+ \S*?(\w+)\.py
torchrun rank           tests/helpers/(\w+)\.py
torchrun launcher       torch\.distributed\.run|torchrun
cli run                 -m megatron_rl (\w+)|megatron-rl (\w+)
vllm engine core        VLLM|EngineCore|vllm
multiprocessing child   multiprocessing\.(\w+)
slurm                   slurm|munge
benchmark               benchmarks/(\w+)\.py
pytest                  pytest
pip                     \bpip\b
"""
KINDS = [(line[:24].strip(), re.compile(line[24:].strip())) for line in _KIND_PATTERNS.strip().splitlines()]
"""A process's kind: the first pattern its command line matches (a group names the detail)."""
TICK = os.sysconf("SC_CLK_TCK")


def kind_of(cmdline: str) -> str:
    for name, pattern in KINDS:
        match = pattern.search(cmdline)
        if match:
            detail = next((g for g in match.groups() if g), None)
            return f"{name}: {detail}" if detail else name
    return "other: " + (os.path.basename(cmdline.split(" ", 1)[0]) or "?")


def machine_cpu_s() -> float:
    with open("/proc/stat") as f:
        fields = f.readline().split()[1:]
    busy = sum(int(x) for x in fields[:8]) - int(fields[3]) - int(fields[4])  # all but idle, iowait
    return busy / TICK


Proc = tuple[int, int]
"""A process: its pid and its start time (clock ticks after boot). Pids are reused: a long
run (a CI) wraps them, and a reading keyed by pid alone would replace an exited process's."""


STATE_DIR_ENV = "MRL_CPU_BY_TEST_DIR"
"""``--by-test``: the directory where ``cpu_test_plugin`` keeps each worker's current test."""
WORKER_ENV = "MRL_CPU_BY_TEST_WORKER"
"""``--by-test``: the pytest worker a process was started under (set by ``cpu_test_plugin``
once a test runs, inherited by every process the test starts)."""


def _pytest_worker(pid: int) -> str | None:
    """The pytest worker a process was started under (:data:`WORKER_ENV` in its environment)."""
    prefix = WORKER_ENV.encode() + b"="
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            for item in f.read().split(b"\0"):
                if item.startswith(prefix):
                    return item.split(b"=", 1)[1].decode()
    except OSError:
        pass
    return None


def sample(
    seen: dict[Proc, tuple[str, float]],
    latest: dict[int, Proc],
    parents: dict[Proc, Proc | None] | None = None,
    workers: dict[Proc, str | None] | None = None,
) -> None:
    """Read every live process's kind and CPU seconds into ``seen``; ``latest`` maps each pid
    to the process holding it now; ``parents`` (when given) gets each new process's parent,
    ``workers`` (when given) its pytest worker."""
    new: list[tuple[Proc, int]] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            fields = stat[stat.rindex(")") + 2 :].split()
            proc, ppid = (pid, int(fields[19])), int(fields[1])  # starttime, ppid
            cpu_s = (int(fields[11]) + int(fields[12])) / TICK  # utime, stime
            # Read each time: Ray renames its workers (ray::IDLE, then ray::<ActorClass>.<method>).
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            if cmdline:
                kind = kind_of(cmdline)
                if kind.startswith("multiprocessing"):  # named by its parent: the cost is the parent's
                    parent = seen.get(latest.get(ppid), ("?",))[0]
                    kind = seen[proc][0] if proc in seen else f"{kind} of {parent}"
            else:  # an exiting process has none: keep what it was
                kind = seen[proc][0] if proc in seen else kind_of(stat[stat.index("(") + 1 : stat.rindex(")")])
            seen[proc] = (kind, cpu_s)
            latest[pid] = proc
            if parents is not None and proc not in parents:
                new.append((proc, ppid))
            if workers is not None and proc not in workers:
                workers[proc] = _pytest_worker(pid)
        except (FileNotFoundError, ProcessLookupError, ValueError, IndexError):
            continue
    for proc, ppid in new:  # after the pass: a parent listed after its child is known by now
        parents[proc] = latest.get(ppid)


def _tree(root: Proc | None, parents: dict[Proc, Proc | None]) -> set[Proc]:
    """``root`` and every process whose recorded parent is in the set (a fixed point: a
    child may be recorded before its parent's own parent is known)."""
    tree = {root} if root is not None else set()
    grew = True
    while grew:
        grew = False
        for proc, parent in parents.items():
            if parent in tree and proc not in tree:
                tree.add(proc)
                grew = True
    return tree


def _current_tests(state_dir: str) -> tuple[dict[str, str], dict[int, str]]:
    """What ``cpu_test_plugin`` wrote: the test each worker runs now, by worker and by the
    worker process's pid."""
    by_worker, by_pid = {}, {}
    for name in os.listdir(state_dir):
        if name.endswith(".tmp"):  # the plugin's file being replaced: the finished one counts
            continue
        try:
            with open(os.path.join(state_dir, name)) as f:
                pid, test = f.read().split("\n", 1)
        except (OSError, ValueError):
            continue
        by_worker[name] = by_pid[int(pid)] = test or "(between tests)"
    return by_worker, by_pid


def _charge(
    charged: dict[str, float],
    seen: dict[Proc, tuple[str, float]],
    last_cpu: dict[Proc, float],
    workers: dict[Proc, str | None],
    state_dir: str,
    started_under: dict[Proc, str],
) -> None:
    """Add each process's CPU since the last call to the test its worker runs now;
    ``started_under`` gets each new process's test (the one it was first charged to)."""
    by_worker, by_pid = _current_tests(state_dir)
    for proc, (_, cpu_s) in seen.items():
        spent = cpu_s - last_cpu.get(proc, 0.0)  # a new process: all of its CPU so far
        last_cpu[proc] = cpu_s
        if spent <= 0:
            continue
        worker = workers.get(proc)
        test = by_pid.get(proc[0]) or (by_worker.get(worker, f"(worker {worker}, no test)") if worker else "(no test)")
        charged[test] = charged.get(test, 0.0) + spent
        started_under.setdefault(proc, test)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--interval-s", type=float, default=1.0)
    parser.add_argument("--out", default=None)
    parser.add_argument("--tree", action="store_true", help="count only the command's process tree")
    parser.add_argument("--by-test", default=None, metavar="FILE", help="CPU seconds per pytest test, to FILE")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --")
    seen: dict[Proc, tuple[str, float]] = {}
    latest: dict[int, Proc] = {}
    parents: dict[Proc, Proc | None] = {}
    sample(seen, latest)
    before = dict(seen)  # what ran before the command: its CPU time so far is not the command's
    env = os.environ
    state: str | None = None  # --by-test: the plugin's directory
    workers: dict[Proc, str | None] | None = None  # --by-test: each process's pytest worker
    charged: dict[str, float] = {}  # --by-test: CPU seconds by test
    started_under: dict[Proc, str] = {}  # --by-test: the test each process started under
    last_cpu = {p: v[1] for p, v in seen.items()}  # each process's CPU when last charged
    if args.by_test:
        import tempfile

        state = tempfile.mkdtemp(prefix="cpu_by_test_")
        workers = {}
        tools = os.path.dirname(os.path.abspath(__file__))
        env = {**os.environ, STATE_DIR_ENV: state, "PYTEST_PLUGINS": "cpu_test_plugin",
               "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), tools]))}  # fmt: skip
    start_cpu, start = machine_cpu_s(), time.monotonic()
    proc = subprocess.Popen(command, env=env)
    while proc.poll() is None:
        time.sleep(args.interval_s)
        sample(seen, latest, parents, workers)
        if state:
            _charge(charged, seen, last_cpu, workers, state, started_under)
    if args.tree:
        tree = _tree(latest.get(proc.pid), parents)
        seen = {p: v for p, v in seen.items() if p in tree}
    totals: dict[str, list[float]] = {}
    for p, (kind, cpu_s) in seen.items():
        spent = cpu_s - (before[p][1] if p in before else 0.0)
        entry = totals.setdefault(kind, [0.0, 0])
        entry[0] += spent
        entry[1] += p not in before
    lines = [{"kind": k, "cpu_s": round(v[0], 1), "processes": v[1]} for k, v in totals.items() if v[0] >= 0.5]
    lines.sort(key=lambda r: -r["cpu_s"])
    machine = machine_cpu_s() - start_cpu
    sampled = sum(v[0] for v in totals.values())
    lines.append({"kind": "total", "wall_s": round(time.monotonic() - start, 1), "machine_cpu_s": round(machine, 1),
                  "sampled_cpu_s": round(sampled, 1), "unsampled_cpu_s": round(machine - sampled, 1),
                  "exit_status": proc.returncode})  # fmt: skip
    text = "\n".join(json.dumps(r) for r in lines)
    print(text, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    if args.by_test:
        started: dict[str, dict[str, int]] = {}  # processes started under each test, by kind (at the end)
        for p, test in started_under.items():
            if p in seen and p not in before:  # --tree: the command's own processes only
                kinds = started.setdefault(test, {})
                kinds[seen[p][0]] = kinds.get(seen[p][0], 0) + 1
        rows = sorted(charged.items(), key=lambda kv: -kv[1])
        with open(args.by_test, "w") as f:
            f.writelines(json.dumps({"test": t, "cpu_s": round(c, 1), "started": started.get(t, {})}) + "\n"
                         for t, c in rows if c >= 0.1)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
