"""A shared cluster's ways of ending a run, through the real ``megatron-rl train`` on the
tiny CPU demo with ``trainer.save_every_steps: 0`` (no checkpoint unless the stop writes one):

* a second launch into a running run's directory exits 2 naming the directory and the
  holder, and changes nothing of the running run (its config, its metrics);
* a run whose Ray temp directory names a cluster that is gone (a stale
  ``ray_current_cluster``) starts a cluster of its own;
* SIGTERM (synchronous loop) and SIGINT (one-step-off loop, an update possibly submitted
  early) stop the run after the step in progress with a checkpoint of it, exit 3, and
  leave no process; the rerun (trained in the test process: resuming is the trainer's)
  continues with every step logged exactly once;
* a second signal aborts at once (exit 128 + N, no process left, the latest checkpoint
  stays the latest) and the rerun still logs every step once;
* an actor rank killed mid-run (the OOM killer, a lost node) ends the run with one
  ``error:`` line and exit 1: the clean-up that follows (closing the dead rank's weight
  sender) logs its own failure to ``RUN_DIR/logs/driver.log`` instead of the screen;
* an actor rank that hangs (SIGSTOP) ends the run after ``actor.call_timeout_s`` with one
  ``error:`` line naming the rank and the call, and no process left;
* a run directory on a 1 MiB tmpfs, too small for a checkpoint: the run stops at the
  first save with one line saying the disk is full and where, the partial checkpoint
  removed (root only: skipped where a tmpfs cannot be mounted).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from megatron_rl.cluster.processes import process_start_time
from megatron_rl.storage.checkpoints import read_latest
from tests.e2e.conftest import ASYNC, EXAMPLE, ROOT, tiny_config, tiny_overrides, train_in_process
from tests.helpers.runs import cmdline, descendants, logged_steps, wait_for_steps, wait_tree_gone

pytestmark = pytest.mark.e2e

QUICK = ("trainer.eval_every_steps=0", "logging.token_diagnostics=false", "trainer.save_every_steps=0",
         "trainer.save_final=false")


def _cli(out_dir: Path, *extra: str, env: dict | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "megatron_rl", "train", str(EXAMPLE), *tiny_overrides(out_dir, *QUICK, *extra)]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)  # fmt: skip


def _stop(proc: subprocess.Popen, *signals: signal.Signals) -> tuple[int, str]:
    """Send ``signals`` to the driver alone (back to back), wait for it; returns its code and output,
    after checking that nothing it started is left 15 s later."""
    tree = descendants({proc.pid})  # Ray's GCS, raylet, the actor, the engine, reward workers
    assert len(tree) >= 5, tree
    for sig in signals:
        proc.send_signal(sig)
    out, _ = proc.communicate(timeout=300)
    left = wait_tree_gone(tree)
    assert not left, f"left 15 s after the driver ended: {left}"
    return proc.returncode, out


def _resume_in_process(out_dir: Path, *extra: str) -> None:
    """The run in ``out_dir`` resumed with ``extra`` and trained to its end in this process."""
    from tests.ray_cluster import shared_ray

    shared_ray("e2e")
    train_in_process(tiny_config(out_dir, *QUICK, *extra))


def test_sigterm_checkpoints_the_step_in_progress_and_a_second_launch_changes_nothing(tmp_path):
    run_dir = tmp_path / "tiny_cpu"
    # A Ray temp directory whose ray_current_cluster names a cluster that is gone (Ray's
    # default address=None would try to join it); short: Ray's socket paths must fit.
    ray_tmp = Path(tempfile.mkdtemp(prefix="r", dir="/tmp"))
    (ray_tmp / "ray_current_cluster").write_text("127.0.0.1:1\n")
    env = {**os.environ, "RAY_TMPDIR": str(ray_tmp)}
    env.pop("RAY_ADDRESS", None)
    run = _cli(tmp_path, "trainer.num_steps=400", "trainer.seed=1", env=env)
    wait_for_steps(run, run_dir, 2)

    # Same directory, another seed: refused before anything is written or started.
    config_before = (run_dir / "config.yaml").read_text()
    second = _cli(tmp_path, "trainer.num_steps=400", "trainer.seed=2")
    out, _ = second.communicate(timeout=120)
    assert second.returncode == 2, out
    assert f"error: the run directory {run_dir} is in use by another run (pid {run.pid} on host" in out, out
    assert "Traceback" not in out
    assert (run_dir / "config.yaml").read_text() == config_before
    assert yaml.safe_load(config_before)["trainer"]["seed"] == 1

    code, out = _stop(run, signal.SIGTERM)
    assert code == 3, out
    stopped = logged_steps(run_dir)
    last = stopped[-1]
    assert stopped == list(range(1, last + 1)) and last >= 2
    assert f"stopped: SIGTERM after step {last} (checkpoint {run_dir / 'checkpoints' / f'step_{last:06d}'})" in out
    assert read_latest(run_dir / "checkpoints").name == f"step_{last:06d}"
    assert "Traceback" not in out, out

    # The rerun resumes in this process (the e2e tier's cluster): resuming is the trainer's, not the CLI's.
    _resume_in_process(tmp_path, f"trainer.num_steps={last + 2}")
    assert logged_steps(run_dir) == list(range(1, last + 3)), "every step once: none lost, none repeated"


def test_sigint_stops_the_one_step_off_loop_and_a_second_signal_aborts(tmp_path):
    run_dir = tmp_path / "tiny_cpu"
    run = _cli(tmp_path, "trainer.num_steps=400", *ASYNC)
    wait_for_steps(run, run_dir, 2)
    code, out = _stop(run, signal.SIGINT)
    assert code == 3, out
    first = logged_steps(run_dir)[-1]
    assert f"stopped: SIGINT after step {first}" in out and "Traceback" not in out, out
    assert read_latest(run_dir / "checkpoints").name == f"step_{first:06d}"

    # Resumed, then two signals back to back (two kinds: pending signals of one kind merge;
    # the lower number is handled first): the second ends the run where it stands.
    again = _cli(tmp_path, "trainer.num_steps=400", *ASYNC)
    wait_for_steps(again, run_dir, first + 2)
    code, out = _stop(again, signal.SIGUSR1, signal.SIGTERM)
    assert code == 128 + signal.SIGTERM, out
    assert "error: aborted by a second stop signal (SIGTERM)" in out and "Traceback" not in out, out
    assert "Warning" not in out, "library notices go to RUN_DIR/logs, resumes included"
    assert read_latest(run_dir / "checkpoints").name == f"step_{first:06d}"
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == [f"step_{first:06d}"]

    _resume_in_process(tmp_path, f"trainer.num_steps={first + 3}", *ASYNC)
    assert logged_steps(run_dir) == list(range(1, first + 4)), "every step once: none lost, none repeated"


def test_a_dead_actor_rank_is_one_error_line_and_its_clean_up_goes_to_the_log(tmp_path):
    run_dir = tmp_path / "tiny_cpu"
    run = _cli(tmp_path, "trainer.num_steps=400")
    wait_for_steps(run, run_dir, 2)
    tree = descendants({run.pid})
    actor = next(pid for pid in tree if cmdline(pid).startswith("ray::ActorWorker"))
    os.kill(actor, signal.SIGKILL)
    out, _ = run.communicate(timeout=300)
    assert run.returncode == 1, out
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "a process of the run died" in errors[0], out
    assert "rerun the same command to resume" in errors[0]
    assert "Traceback" not in out, out
    assert not wait_tree_gone(tree)
    log = (run_dir / "logs" / "driver.log").read_text()
    assert "Traceback" in log and "clean-up failed" in log  # the details are kept, off the screen


def test_a_hung_actor_rank_ends_the_run_after_the_call_timeout_naming_it(tmp_path):
    run_dir = tmp_path / "tiny_cpu"
    run = _cli(tmp_path, "trainer.num_steps=400", "actor.call_timeout_s=25")
    wait_for_steps(run, run_dir, 2)
    tree = descendants({run.pid})
    actor = next(pid for pid in tree if cmdline(pid).startswith("ray::ActorWorker"))
    os.kill(actor, signal.SIGSTOP)  # alive, silent: no error ever comes back from it
    stopped = time.monotonic()
    try:
        out, _ = run.communicate(timeout=300)
    finally:
        if process_start_time(actor) == tree[actor]:  # not reaped: let it go (it is killed below)
            os.kill(actor, signal.SIGCONT)
    assert run.returncode == 1, out
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out
    assert "actor rank(s) [0] did not finish" in errors[0] and "within 25 s (actor.call_timeout_s)" in errors[0]
    assert "Traceback" not in out and time.monotonic() - stopped < 150, out
    assert not wait_tree_gone(tree)


def test_a_checkpoint_that_fills_the_disk_is_named_as_such(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(mount)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.decode().strip()}")
    try:
        run = _cli(mount, "trainer.num_steps=4", "trainer.save_every_steps=2")  # a checkpoint is ~1.5 MiB
        out, _ = run.communicate(timeout=600)
        checkpoints = mount / "tiny_cpu" / "checkpoints"
        assert run.returncode == 1, out
        errors = [line for line in out.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, out
        assert f"error: step 2: no space left on the device of {checkpoints} while writing the checkpoint " \
               "step_000002" in errors[0], out  # fmt: skip
        assert "Traceback" not in out, out
        assert not any(checkpoints.glob(".step_*")) and not any(checkpoints.glob("step_*"))
        assert logged_steps(mount / "tiny_cpu") == [1, 2]  # the metrics of the steps that ran are whole
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)
