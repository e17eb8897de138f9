"""``megatron-rl train``: validate a run config, then train (or, with ``--dry-run``, save it).

    megatron-rl train CONFIG [section.field=value ...] [--dry-run]

Before any process starts, the config is loaded (errors name file and line) and the
pre-flight (:mod:`megatron_rl.loop.preflight`) checks every name, path, data row and the
checkpoint to resume from; ``--dry-run`` runs exactly the same pre-flight, so a dry run
that passes means the run gets past start-up. The run directory is held by one run at a
time (:mod:`megatron_rl.loop.run_lock`). SIGTERM, SIGINT or SIGUSR1 stop the run after the
step in progress with a checkpoint of it; a second one aborts at once
(:mod:`megatron_rl.loop.stop`). A failure is one ``error:`` line on the screen; its
traceback goes to ``RUN_DIR/logs/driver.log``. A driver killed without warning leaves no
process behind (:mod:`.reaper`).

Exit codes: 0 done; 1 a failure during the run (non-finite steps, weights or rewards, a
process of the run died: rerun to resume); 2 a bad config, path, data row or checkpoint,
a run directory in use, a Ray cluster that cannot be joined (nothing was started);
3 stopped by a signal, checkpointed (rerun to continue); 128 + N aborted by a second
signal N (the latest checkpoint stays the latest).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from megatron_rl.cli import EXIT_FAILURE, EXIT_OK, EXIT_STOPPED, EXIT_USAGE
from megatron_rl.config.lib import ConfigError, ConfigRenameWarning, dump_yaml, save_resolved

TASK_KEY = "data.task"
"""The config field naming the task (formerly ``data.reward``, still accepted)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``train`` arguments."""
    parser.add_argument("config", metavar="CONFIG", help="run config YAML file (see docs/config.md)")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="section.field=value",
        help="override any config field, e.g. trainer.lr=1e-6 algorithm.ar.alpha=0.3 (values are YAML)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="validate the config and placement, print the resolved config and save it to the run "
        "directory; train nothing",
    )


@contextlib.contextmanager
def renamed_fields_used() -> Iterator[dict[str, str]]:
    """Collect ``{current path: path as written}`` of every renamed config field given by
    its old name while the block runs; the rename notices are still shown."""
    renamed: dict[str, str] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("always", ConfigRenameWarning)
        show = warnings.showwarning

        def record(message, category, filename, lineno, file=None, line=None) -> None:
            if isinstance(message, ConfigRenameWarning):
                renamed[message.new_path] = message.path
            show(message, category, filename, lineno, file, line)

        warnings.showwarning = record
        yield renamed


def _placement_summary(config) -> str:
    par, roll, trainer = config.parallel, config.rollout, config.trainer
    return (
        f"actor: {par.num_actor_ranks} rank(s) = TP {par.tensor_model_parallel_size} x "
        f"PP {par.pipeline_model_parallel_size} x CP {par.context_parallel_size} x "
        f"DP {par.resolved_data_parallel_size}\n"
        f"rollout: {roll.num_engines} {roll.engine} engine(s), {roll.placement}\n"
        f"batch: {roll.num_prompts_per_step} prompts x {roll.num_samples_per_prompt} samples = "
        f"{roll.num_samples_per_step} responses per step, {trainer.num_minibatches_per_step} mini-batch(es) "
        f"x {trainer.num_epochs_per_step} epoch(s)"
    )


def _print_yaml(text: str) -> None:
    if sys.stdout.isatty():
        from rich.console import Console
        from rich.syntax import Syntax

        Console().print(Syntax(text, "yaml", background_color="default"))
    else:
        sys.stdout.write(text)
        sys.stdout.flush()


@dataclass(frozen=True)
class RunKind:
    """What ``train`` and ``sft`` differ in; the rest of a run's start, stop and exit codes
    is this module's, for both."""

    load: Callable[[str, list[str]], Any]
    """``(yaml path, overrides) -> config``."""
    preflight: Callable[[Any, dict[str, str]], Any]
    """``(config, renamed fields used) -> the pre-flight's result``; raises on a bad input."""
    make_trainer: Callable[[Any, Any], Any]
    """``(config, pre-flight result) -> trainer`` (``run()``, ``close()``, ``step``, ``stop``)."""
    summary: Callable[[Any], str]
    """The layout and batch lines a dry run prints."""


def _rl_preflight(config, renamed: dict[str, str]):
    from megatron_rl.loop.preflight import preflight

    return preflight(config, task_key=renamed.get(TASK_KEY, TASK_KEY))


def _rl_trainer(config, checked):
    from megatron_rl.loop.pipeline import make_trainer

    return make_trainer(config, checked=checked)


def _rl_load(path: str, overrides: list[str]):
    from megatron_rl.config.run import load_run_config

    return load_run_config(path, overrides)


RL = RunKind(load=_rl_load, preflight=_rl_preflight, make_trainer=_rl_trainer, summary=_placement_summary)
"""``megatron-rl train``."""


def run(args: argparse.Namespace) -> int:
    """Validate the config, then train or (``--dry-run``) print and save it; returns the exit code."""
    return launch(args, RL)


def launch(args: argparse.Namespace, kind: RunKind) -> int:
    """:func:`run` for a run of ``kind`` (``train`` or ``sft``)."""
    with renamed_fields_used() as renamed:
        config = kind.load(args.config, args.overrides)
    try:  # the same checks for a run and a dry run, before any process starts
        checked = kind.preflight(config, renamed)
    except _BAD_INPUT as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    from megatron_rl.loop.run_lock import RunDirInUseError, lock_run_dir
    from megatron_rl.storage.durable import disk_full

    try:  # held until this process ends; a dry run must not rewrite a running run's config either
        lock = lock_run_dir(config.run_dir)
    except RunDirInUseError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:
        if not disk_full(e):
            raise
        print(f"error: no space left on the device of {config.run_dir}; free space (or point trainer.output_dir "
              "elsewhere), then rerun", file=sys.stderr)  # fmt: skip
        return EXIT_USAGE
    with lock:
        if not args.dry_run:
            return _train(config, checked, kind)
        _print_yaml(dump_yaml(config))
        saved = save_resolved(config, config.run_dir)
    print(kind.summary(config), file=sys.stderr)
    print(f"dry run: config is valid; resolved config saved to {saved}", file=sys.stderr)
    return EXIT_OK


# A bad input the pre-flight reports (besides ConfigError, which ``main`` prints): a bad data
# file or row, or ``trainer.resume: never`` on a run directory that holds checkpoints.
_BAD_INPUT = (ConfigError, ValueError, FileExistsError, FileNotFoundError)


def _train(config, checked, kind: RunKind) -> int:
    import logging

    from megatron_rl.loop.stop import RunStopped, StopSignals
    from megatron_rl.observability.run_log import FILE_ONLY, setup_process_logging

    # First: the imports below warn (megatron-core without Apex/TE); the notices go to the file.
    log_file = config.run_dir / "logs" / "driver.log"
    setup_process_logging(log_file)
    log = logging.getLogger("megatron_rl.cli.train")
    stop = StopSignals()
    stop.install()  # from here a signal stops the run cleanly, start-up included
    # Imported here: the trainer pulls in Ray, megatron-core and transformers.
    from ray.exceptions import RayActorError

    from megatron_rl.actor.checkpoint.save_load import NonFiniteWeightsError
    from megatron_rl.actor.group import NonFiniteStepsError
    from megatron_rl.cli import reaper
    from megatron_rl.loop.builder import RayClusterError
    from megatron_rl.rewards import AllRewardsFailedError

    # Lives until this process has exited (Ray's own shutdown at exit included) and then ends
    # whatever the run left behind: the net under a driver killed outright.
    reaper.start()
    try:
        trainer = kind.make_trainer(config, checked)
    except (*_BAD_INPUT, RayClusterError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as e:  # noqa: BLE001  (one line here, the traceback in the log)
        log.error("the run failed to start", exc_info=True, extra=FILE_ONLY)
        print(f"error: the run failed to start: {_describe(e)} (traceback in {log_file})", file=sys.stderr)
        return EXIT_FAILURE
    stop.install()  # again: ray.init put its own SIGTERM handler (sys.exit) in place
    trainer.stop = stop
    try:
        trainer.run()
        code = EXIT_OK
    except RunStopped as e:
        saved = f"checkpoint {config.run_dir / 'checkpoints' / f'step_{e.step:06d}'}" if e.saved else "no new checkpoint"
        print(f"stopped: {e.signal_name} after step {e.step} ({saved}); rerun the same command to continue",
              file=sys.stderr)  # fmt: skip
        code = EXIT_STOPPED
    except (NonFiniteStepsError, NonFiniteWeightsError, AllRewardsFailedError) as e:
        # Raised inside a Ray actor, the error arrives wrapped; its cause is the message.
        print(f"error: step {trainer.step}: {getattr(e, 'cause', None) or e}", file=sys.stderr)
        code = EXIT_FAILURE
    except Exception as e:  # noqa: BLE001  (any failure: one line here, the traceback in the log)
        # A rank killed from outside (the OOM killer, a node lost) is said as such: resumable.
        what = f"a process of the run died ({_describe(e)})" if isinstance(e, RayActorError) else _describe(e)
        log.error("the run failed at step %d", trainer.step, exc_info=True, extra=FILE_ONLY)
        print(f"error: step {trainer.step}: {what} (traceback in {log_file}); rerun the same command to "
              "resume from the last checkpoint", file=sys.stderr)  # fmt: skip
        code = EXIT_FAILURE
    code = _close(trainer, code, log, log_file)
    if code != EXIT_OK:
        return code
    saved = any((config.run_dir / "checkpoints").glob("step_*"))
    print(
        f"done: metrics in {config.run_dir / 'metrics.jsonl'}"
        + (f", checkpoints in {config.run_dir / 'checkpoints'}" if saved else ", no checkpoint (trainer.save_final)")
        + f", logs in {config.run_dir / 'logs'}; plot with: python tools/plot_run.py {config.run_dir}",
        file=sys.stderr,
    )
    return EXIT_OK


def _describe(e: BaseException) -> str:
    """One line for a failure: its type and first line; a full disk named as such. An error
    raised in a Ray actor arrives wrapped: its ``cause`` is the error."""
    from megatron_rl.storage.durable import DiskFullError, disk_full

    cause = getattr(e, "cause", None) or e
    first = (str(cause).strip().splitlines() or [""])[0][:300]
    if isinstance(cause, DiskFullError):
        return first
    if disk_full(e):
        return f"the disk is full ({type(cause).__name__}: {first})"
    return f"{type(cause).__name__}: {first}"


def _close(trainer, code: int, log, log_file) -> int:
    """Stop every process of the run; a clean-up failure (a rank that died already) goes to
    the log, and is the run's error only if nothing else failed."""
    from megatron_rl.observability.run_log import FILE_ONLY  # loaded by _train already

    try:
        trainer.close()
    except Exception as e:  # noqa: BLE001
        log.error("clean-up failed", exc_info=True, extra=FILE_ONLY)
        if code == EXIT_OK:
            print(f"error: the run finished but stopping its processes failed ({type(e).__name__}; traceback in "
                  f"{log_file})", file=sys.stderr)  # fmt: skip
            return EXIT_FAILURE
    return code
