"""tools/cpu_by_process.py counts a child's CPU seconds under its kind."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
from cpu_by_process import _tree, kind_of  # noqa: E402


def test_kinds_are_read_from_the_command_line():
    assert kind_of("ray::ActorWorker.update_policy") == "ray actor: ActorWorker"
    assert kind_of("ray::IDLE") == "ray idle worker"
    assert (
        kind_of("/venv/bin/python -u tests/helpers/actor_moe_worker.py spec.json out")
        == "torchrun rank: actor_moe_worker"
    )
    assert (
        kind_of("/venv/bin/python /repo/tests/helpers/fork_ranks.py 4 /repo/tests/helpers/actor_worker.py spec.json out")
        == "forked ranks: actor_worker"
    )
    assert kind_of("/venv/bin/python -m megatron_rl train examples/tiny_cpu.yaml") == "cli run: train"
    assert kind_of("/usr/bin/sleep 3") == "other: sleep"
    spawned = "/venv/bin/python -c from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5, pipe_handle=7)"
    assert kind_of(spawned) == "multiprocessing child: spawn"


def test_a_spawned_child_is_named_by_its_parent(tmp_path):
    """megatron's checkpoint writer spawns a Manager in each actor process: its CPU time is
    the actor's cost, so the report names the parent's kind."""
    out = tmp_path / "cpu.json"
    parent = ("import multiprocessing as mp, time\n"
              "def busy():\n    t = time.process_time()\n    while time.process_time() - t < 1.5: pass\n"
              "if __name__ == '__main__':\n    p = mp.get_context('spawn').Process(target=busy); p.start(); p.join()")  # fmt: skip
    # The tool samples the whole machine, so the parent needs a kind no other process has: under
    # tmp_path (/tmp/pytest-of-...) a script's kind is `pytest`, shared with the xdist workers and
    # their own spawned children; `benchmarks/<name>.py` makes it `benchmark: <name>`.
    script = tmp_path / "benchmarks" / f"spawn_probe_{os.getpid()}.py"
    script.parent.mkdir()
    script.write_text(parent)
    cmd = [sys.executable, str(ROOT / "tools" / "cpu_by_process.py"), "--interval-s", "0.2", "--out", str(out),
           "--", sys.executable, str(script)]  # fmt: skip
    assert subprocess.run(cmd, capture_output=True, timeout=60).returncode == 0
    kinds = {json.loads(line)["kind"]: json.loads(line) for line in out.read_text().splitlines()}
    child = kinds.get(f"multiprocessing child: spawn of {kind_of(f'{sys.executable} {script}')}")
    assert child and 1.2 <= child["cpu_s"] <= 2.5, kinds


def test_a_busy_child_is_counted(tmp_path):
    out = tmp_path / "cpu.json"
    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.5: pass"
    cmd = [sys.executable, str(ROOT / "tools" / "cpu_by_process.py"), "--interval-s", "0.2", "--out", str(out),
           "--", sys.executable, "-c", busy]  # fmt: skip
    assert subprocess.run(cmd, capture_output=True, timeout=60).returncode == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    total = lines[-1]
    assert total["kind"] == "total" and total["exit_status"] == 0
    child = [r for r in lines[:-1] if r["kind"] == f"other: {Path(sys.executable).name}"]
    assert child and 1.2 <= child[0]["cpu_s"] <= 2.5, lines
    assert total["machine_cpu_s"] >= 1.2


def test_tree_counts_only_the_commands_processes(tmp_path):
    """``--tree``: a busy process outside the command's tree (here started before it, of the
    same kind) is left out; the command's grandchild is counted."""
    out = tmp_path / "cpu.json"
    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < {}: pass"
    outsider = subprocess.Popen([sys.executable, "-c", busy.format(4.0)])
    try:
        # The command is a shell whose child (the grandchild of the tool) burns 1.5 CPU-s.
        inner = f"{sys.executable} -c '{busy.format(1.5)}'"
        cmd = [sys.executable, str(ROOT / "tools" / "cpu_by_process.py"), "--tree", "--interval-s", "0.2",
               "--out", str(out), "--", "bash", "-c", f"{inner}; true"]  # fmt: skip
        assert subprocess.run(cmd, capture_output=True, timeout=60).returncode == 0
    finally:
        outsider.kill()
        outsider.wait()
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    python = [r for r in lines[:-1] if r["kind"] == f"other: {Path(sys.executable).name}"]
    assert python and 1.2 <= python[0]["cpu_s"] <= 2.5 and python[0]["processes"] == 1, lines


def test_a_reused_pid_is_another_process():
    """Processes are (pid, start time): pid 10 held first by a child of the command, later by
    an outsider's child; only the first is in the command's tree."""
    parents = {(1, 0): None, (10, 5): (1, 0), (10, 900): (2, 0), (11, 950): (10, 900), (12, 60): (10, 5)}
    assert _tree((1, 0), parents) == {(1, 0), (10, 5), (12, 60)}
    assert _tree(None, parents) == set()  # the command ended before the first reading


def test_by_test_charges_a_tests_child_to_the_test(tmp_path):
    """``--by-test``: the CPU of a process a test starts is that test's, and the process is
    counted as started under it; a test that only sleeps is charged (almost) nothing."""
    tests = tmp_path / "test_probe.py"
    tests.write_text(
        "import subprocess, sys, time\n"
        "BUSY = 'import time\\nt = time.process_time()\\nwhile time.process_time() - t < 1.5: pass'\n"
        "def test_busy():\n    subprocess.run([sys.executable, '-c', BUSY], check=True)\n"
        "def test_idle():\n    time.sleep(1.0)\n"
    )  # fmt: skip
    out, by_test = tmp_path / "cpu.json", tmp_path / "tests.json"
    # An outer measurement's marks (this suite run under --by-test) must not reach the inner run.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MRL_CPU_BY_TEST", "PYTEST_"))}
    cmd = [sys.executable, str(ROOT / "tools" / "cpu_by_process.py"), "--interval-s", "0.2", "--out", str(out),
           "--by-test", str(by_test), "--", sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "-p", "no:xdist", str(tests)]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    charged = {json.loads(line)["test"]: json.loads(line)["cpu_s"] for line in by_test.read_text().splitlines()}
    busy = next((c for t, c in charged.items() if t.endswith("test_probe.py::test_busy")), None)
    idle = next((c for t, c in charged.items() if t.endswith("test_probe.py::test_idle")), 0.0)
    assert busy is not None and 1.2 <= busy <= 3.0, charged
    assert idle <= 0.5, charged
    rows = [json.loads(line) for line in by_test.read_text().splitlines()]
    started = next(r["started"] for r in rows if r["test"].endswith("test_probe.py::test_busy"))
    assert sum(started.values()) == 1 and next(iter(started)).startswith("other: python"), rows
