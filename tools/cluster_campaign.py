"""The reliability campaign's shared-cluster stage (issue 34): what a shared Slurm node does
to a run, through the real ``megatron-rl train`` on the tiny CPU demo. Run by
``tools/reliability_campaign.py --only cluster`` (it passes ``record`` and ``start``).

Cases (category ``cluster``): a stale ``ray_current_cluster`` file; a second launch into a
running run's directory; SIGTERM mid-run (synchronous loop), SIGINT (one-step-off loop),
SIGUSR1 (Slurm's ``--signal``) each followed by a rerun; a second signal; an actor rank
killed (SIGKILL) and one stopped (SIGSTOP); a rollout engine stopped (SIGSTOP, the run must
restart it and finish); checkpoint retention; a disk that is full at start, fills during a
checkpoint, and fills between steps (tmpfs mounts: root only, otherwise ``skipped``).
Category ``code_execution``: the callables the issue found passing as rewards.

Handled means: the documented exit code (0 finished, 1 error, 2 refused, 3 stopped, 128+N
aborted), the expected ``error:``/``stopped:`` line, no traceback on screen, every step
logged exactly once once the reruns are done (else ``lost``), and no process of the run
alive 15 s after its driver ended (``orphans``, which count as crashed).
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from megatron_rl.storage.checkpoints import read_latest
from tests.helpers.runs import cmdline, descendants, logged_steps, wait_for_steps, wait_tree_gone

QUICK = ("trainer.save_every_steps=0", "logging.token_diagnostics=false", "trainer.num_steps=400")
ASYNC = ("rollout.placement=disaggregated", "rollout.max_staleness=1", "rollout.tis_cap=2.0")
RUN = "tiny_cpu"


class Ctx:
    """What the stage needs from the campaign script: its ``record`` and a way to start a run
    (``start(out_dir, *overrides, env=...)`` -> a ``Popen`` with stdout+stderr piped)."""

    def __init__(self, out: Path, record: Callable[..., None], start: Callable[..., subprocess.Popen]):
        self.out, self.record, self.start = out, record, start

    def finish(self, proc: subprocess.Popen, timeout: float = 900) -> tuple[int, str, dict[int, str]]:
        """Wait for the driver; ``(exit code, output, processes of the run left 15 s later)``."""
        tree = descendants({proc.pid})
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            return -9, out, wait_tree_gone(tree)
        return proc.returncode, out, wait_tree_gone(tree)

    def signal_and_finish(self, proc: subprocess.Popen, *signals: signal.Signals) -> tuple[int, str, dict[int, str]]:
        tree = descendants({proc.pid})  # Ray's processes, the actor, the engine, reward workers
        for sig in signals:
            proc.send_signal(sig)
        out, _ = proc.communicate(timeout=600)
        return proc.returncode, out, wait_tree_gone(tree)

    def judge(self, case: str, code: int, out: str, *, expect: int, needles: tuple[str, ...] = (),
              steps: list[int] | None = None, want_steps: list[int] | None = None,
              orphans: dict[int, str] | None = None, require: dict[str, bool] | None = None,
              category: str = "cluster", **details) -> bool:  # fmt: skip
        """Record the case; returns whether it was handled. ``require``: further checks by
        name (any false one: crashed)."""
        errors = [line for line in out.splitlines() if line.startswith(("error:", "stopped:"))]
        failed = [name for name, ok in (require or {}).items() if not ok]
        if "Traceback" in out or code == -9 or orphans or failed:
            outcome = "crashed"
        elif code == 0 and expect != 0:
            outcome = "accepted"
        elif code != expect or not all(n in out for n in needles) or len(errors) > 1:
            outcome = "crashed"
        elif want_steps is not None and steps != want_steps:
            outcome = "lost"
        else:
            outcome = "handled"
        self.record(category, case, outcome, exit=code, message=(errors[-1] if errors else "")[:300], steps=steps,
                    orphans=list((orphans or {}).values()), failed_checks=failed, **details)  # fmt: skip
        return outcome == "handled"


def _rerun(ctx: Ctx, out_dir: Path, num_steps: int, *extra: str, env: dict | None = None) -> tuple[int, str]:
    code, text, _ = ctx.finish(ctx.start(out_dir, *QUICK, *extra, f"trainer.num_steps={num_steps}", env=env))
    return code, text


def second_launch_and_sigterm(ctx: Ctx) -> None:
    out_dir = ctx.out / "cluster_sigterm"
    run_dir = out_dir / RUN
    # A Ray temp directory naming a cluster that is gone (short: Ray's socket paths must fit).
    ray_tmp = Path(tempfile.mkdtemp(prefix="r", dir="/tmp"))
    (ray_tmp / "ray_current_cluster").write_text("127.0.0.1:1\n")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_TMPDIR": str(ray_tmp)}
    first = ctx.start(out_dir, *QUICK, "trainer.seed=1", env=env)
    try:
        wait_for_steps(first, run_dir, 2)
    except AssertionError as e:
        ctx.record("cluster", "stale_ray_cluster_file", "crashed", error=str(e)[-300:])
        return
    ctx.record("cluster", "stale_ray_cluster_file", "handled", steps=logged_steps(run_dir))
    config_before = (run_dir / "config.yaml").read_text()
    code, text, orphans = ctx.finish(ctx.start(out_dir, *QUICK, "trainer.seed=2"), timeout=300)
    unchanged = (run_dir / "config.yaml").read_text() == config_before
    ctx.judge("second_launch_into_a_running_run_dir", code, text, expect=2, orphans=orphans,
              needles=(f"error: the run directory {run_dir} is in use by another run (pid {first.pid}",),
              require={"config_unchanged": unchanged})  # fmt: skip
    code, text, orphans = ctx.signal_and_finish(first, signal.SIGTERM)
    last = logged_steps(run_dir)[-1] if logged_steps(run_dir) else 0
    latest = read_latest(run_dir / "checkpoints")
    checkpointed = latest is not None and latest.name == f"step_{last:06d}"
    rerun_code, rerun_text = _rerun(ctx, out_dir, last + 2, env=env)
    ctx.judge("sigterm_mid_run", code, text + ("" if rerun_code == 0 else rerun_text), expect=3, orphans=orphans,
              needles=(f"stopped: SIGTERM after step {last} (checkpoint",), steps=logged_steps(run_dir),
              want_steps=list(range(1, last + 3)), require={"checkpoint_of_the_stop_step": checkpointed},
              rerun_exit=rerun_code)  # fmt: skip


def sigint_and_second_signal(ctx: Ctx) -> None:
    out_dir = ctx.out / "cluster_sigint"
    run_dir = out_dir / RUN
    run = ctx.start(out_dir, *QUICK, *ASYNC)
    wait_for_steps(run, run_dir, 2)
    code, text, orphans = ctx.signal_and_finish(run, signal.SIGINT)
    first = logged_steps(run_dir)[-1]
    needles = (f"stopped: SIGINT after step {first}",)
    ctx.judge("sigint_one_step_off", code, text, expect=3, orphans=orphans, needles=needles)
    # Two signals back to back (two kinds: pending signals of one kind merge).
    again = ctx.start(out_dir, *QUICK, *ASYNC)
    wait_for_steps(again, run_dir, first + 2)
    code, text, orphans = ctx.signal_and_finish(again, signal.SIGUSR1, signal.SIGTERM)
    latest = read_latest(run_dir / "checkpoints")
    rerun_code, rerun_text = _rerun(ctx, out_dir, first + 3, *ASYNC)
    ctx.judge("second_signal_aborts", code, text + ("" if rerun_code == 0 else rerun_text),
              expect=128 + signal.SIGTERM, needles=("error: aborted by a second stop signal (SIGTERM)",),
              orphans=orphans, steps=logged_steps(run_dir), want_steps=list(range(1, first + 4)),
              require={"latest_unchanged": latest is not None and latest.name == f"step_{first:06d}"},
              rerun_exit=rerun_code)  # fmt: skip


def sigusr1(ctx: Ctx) -> None:
    """Slurm's ``--signal=B:USR1@300``: what ``slurm/train.sbatch`` forwards to the driver."""
    out_dir = ctx.out / "cluster_sigusr1"
    run_dir = out_dir / RUN
    run = ctx.start(out_dir, *QUICK)
    wait_for_steps(run, run_dir, 2)
    code, text, orphans = ctx.signal_and_finish(run, signal.SIGUSR1)
    last = logged_steps(run_dir)[-1]
    rerun_code, rerun_text = _rerun(ctx, out_dir, last + 1)
    ctx.judge("sigusr1_mid_run", code, text + ("" if rerun_code == 0 else rerun_text), expect=3, orphans=orphans,
              needles=(f"stopped: SIGUSR1 after step {last}",), steps=logged_steps(run_dir),
              want_steps=list(range(1, last + 2)), rerun_exit=rerun_code)  # fmt: skip


def _signal_worker(ctx: Ctx, case: str, worker: str, sig: signal.Signals, *extra: str, expect: int,
                   needles: tuple[str, ...], num_steps: int = 400) -> None:  # fmt: skip
    out_dir = ctx.out / f"cluster_{case}"
    run_dir = out_dir / RUN
    run = ctx.start(out_dir, *QUICK, *extra, f"trainer.num_steps={num_steps}")
    wait_for_steps(run, run_dir, 2)
    tree = descendants({run.pid})
    pid = next((p for p in tree if cmdline(p).startswith(worker)), None)
    if pid is None:
        run.kill()
        ctx.record("cluster", case, "crashed", error=f"no {worker} process found")
        return
    os.kill(pid, sig)
    try:
        code, text, orphans = ctx.finish(run, timeout=600)
    finally:
        if sig == signal.SIGSTOP:  # still there (not reaped): let it go so that it can die
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    steps = logged_steps(run_dir)
    want = list(range(1, num_steps + 1)) if expect == 0 else None
    ctx.judge(case, code, text, expect=expect, needles=needles, orphans=orphans, steps=steps, want_steps=want)


def workers(ctx: Ctx) -> None:
    _signal_worker(ctx, "actor_rank_killed", "ray::ActorWorker", signal.SIGKILL, expect=1,
                   needles=("a process of the run died", "rerun the same command to resume"))  # fmt: skip
    _signal_worker(ctx, "actor_rank_stopped", "ray::ActorWorker", signal.SIGSTOP, "actor.call_timeout_s=45", expect=1,
                   needles=("actor rank(s) [0] did not finish", "within 45 s (actor.call_timeout_s)"))  # fmt: skip
    # An engine that hangs in whatever call comes next (generation, sleep, a bucket's load):
    # the pool restarts it and the run finishes.
    _signal_worker(ctx, "engine_stopped", "ray::EngineWorker", signal.SIGSTOP, "rollout.pool.request_timeout_s=20",
                   "rollout.pool.weight_sync_timeout_s=20", "rollout.pool.restart_timeout_s=60", expect=0, needles=(),
                   num_steps=5)  # fmt: skip


def retention(ctx: Ctx) -> None:
    out_dir = ctx.out / "cluster_retention"
    checkpoints = out_dir / RUN / "checkpoints"
    code, text, orphans = ctx.finish(ctx.start(out_dir, *QUICK, "trainer.num_steps=5", "trainer.save_every_steps=1",
                                               "trainer.keep_last_checkpoints=2"))  # fmt: skip
    kept = sorted(p.name for p in checkpoints.glob("step_*"))
    ok = kept == ["step_000004", "step_000005"] and read_latest(checkpoints).name == "step_000005"
    ctx.judge("keep_last_checkpoints_2", code, text, expect=0, orphans=orphans, steps=logged_steps(out_dir / RUN),
              want_steps=[1, 2, 3, 4, 5], require={"kept_the_last_two": ok}, kept=kept)  # fmt: skip


def _tmpfs(mount: Path, size: str) -> str | None:
    """Mount a tmpfs of ``size`` on ``mount``; the reason it could not (no root), or None."""
    mount.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True)
    return None if done.returncode == 0 else done.stderr.decode().strip() or "mount failed"


def _fill(directory: Path) -> None:
    """Write a file in ``directory`` until its file system is full."""
    with open(directory / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * (64 << 10))
                f.flush()
        except OSError:
            pass


def disk_full(ctx: Ctx) -> None:
    cases = ("disk_full_at_start", "disk_fills_during_a_checkpoint", "disk_fills_between_steps")
    mount = ctx.out / "cluster_tmpfs"
    why = _tmpfs(mount, "1M")
    if why:
        for case in cases:
            ctx.record("cluster", case, "skipped", reason=f"cannot mount a tmpfs: {why}")
        return
    try:
        _fill(mount)
        code, text, orphans = ctx.finish(ctx.start(mount / "a", *QUICK, "trainer.num_steps=2"), timeout=300)
        ctx.judge(cases[0], code, text, expect=2, needles=("trainer.output_dir", "is full"), orphans=orphans)
        (mount / "filler").unlink()

        # A checkpoint is ~1.5 MiB: more than the 1 MiB there is.
        code, text, orphans = ctx.finish(ctx.start(mount / "b", *QUICK, "trainer.num_steps=4",
                                                   "trainer.save_every_steps=2"))  # fmt: skip
        checkpoints = mount / "b" / RUN / "checkpoints"
        leftovers = [p.name for p in checkpoints.glob("*step_*")]
        ctx.judge(cases[1], code, text, expect=1, require={"no_partial_checkpoint": not leftovers},
                  needles=(f"no space left on the device of {checkpoints} while writing the checkpoint step_000002",),
                  orphans=orphans, steps=logged_steps(mount / "b" / RUN), want_steps=[1, 2])  # fmt: skip
        subprocess.run(["rm", "-rf", str(mount / "a"), str(mount / "b")], check=True)

        run_dir = mount / "c" / RUN
        run = ctx.start(mount / "c", *QUICK)
        wait_for_steps(run, run_dir, 2)
        _fill(mount)
        code, text, orphans = ctx.finish(run)
        whole = logged_steps(run_dir)  # read_metrics raises on a torn line
        (mount / "filler").unlink()
        rerun_code, rerun_text = _rerun(ctx, mount / "c", 3, "trainer.save_final=false")  # no room for one
        ctx.judge(cases[2], code, text + ("" if rerun_code == 0 else rerun_text), expect=1, needles=("no space left",),
                  orphans=orphans, steps=logged_steps(run_dir), want_steps=[1, 2, 3], steps_before_rerun=whole)  # fmt: skip
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


UNDECLARED = ("cProfile:run", "profile:run", "timeit:timeit", "pdb:run", "webbrowser:open")
"""Importable callables that would run a response as code: none is a declared reward."""


def undeclared_rewards(ctx: Ctx) -> None:
    for task in UNDECLARED:
        out_dir = ctx.out / f"cluster_task_{task.replace(':', '_')}"
        code, text, orphans = ctx.finish(ctx.start(out_dir, *QUICK, f"data.task={task}"), timeout=300)
        ctx.judge(f"data.task={task}", code, text, expect=2, needles=("data.task", "not declared a reward"),
                  orphans=orphans, category="code_execution")  # fmt: skip


def campaign_cluster(out: Path, record: Callable[..., None], start: Callable[..., subprocess.Popen]) -> None:
    ctx = Ctx(out, record, start)
    for stage in (undeclared_rewards, second_launch_and_sigterm, sigint_and_second_signal, sigusr1, workers,
                  retention, disk_full):  # fmt: skip
        try:
            stage(ctx)
        except Exception as e:  # a stage that failed to run counts against the campaign
            record("cluster", stage.__name__, "crashed", error=f"{type(e).__name__}: {e}"[-300:])
