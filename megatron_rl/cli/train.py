"""``megatron-rl train``: validate a run config, then train (or, with ``--dry-run``, save it).

    megatron-rl train CONFIG [section.field=value ...] [--dry-run]

Before any process starts, the config is loaded (errors name file and line) and the
pre-flight (:mod:`megatron_rl.loop.preflight`) checks every name, path, data row and the
checkpoint to resume from; ``--dry-run`` runs exactly the same pre-flight, so a dry run
that passes means the run gets past start-up. Exit codes: 0 done; 2 a bad config, path,
data row or checkpoint (``error: ...`` naming the field, file or row; no traceback);
1 a run stopped by a failure it detected itself (non-finite steps, weights or rewards).
A driver killed without warning leaves no process behind (:mod:`.reaper`).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import warnings
from collections.abc import Iterator

from megatron_rl.cli import EXIT_FAILURE, EXIT_OK, EXIT_USAGE
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


def run(args: argparse.Namespace) -> int:
    """Validate the config, then train or (``--dry-run``) print and save it; returns the exit code."""
    from megatron_rl.config.run import load_run_config
    from megatron_rl.loop.preflight import preflight

    with renamed_fields_used() as renamed:
        config = load_run_config(args.config, args.overrides)
    try:  # the same checks for a run and a dry run, before any process starts
        checked = preflight(config, task_key=renamed.get(TASK_KEY, TASK_KEY))
    except _BAD_INPUT as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if not args.dry_run:
        return _train(config, checked)
    _print_yaml(dump_yaml(config))
    saved = save_resolved(config, config.run_dir)
    print(_placement_summary(config), file=sys.stderr)
    print(f"dry run: config is valid; resolved config saved to {saved}", file=sys.stderr)
    return EXIT_OK


# A bad input the pre-flight reports (besides ConfigError, which ``main`` prints): a bad data
# file or row, or ``trainer.resume: never`` on a run directory that holds checkpoints.
_BAD_INPUT = (ConfigError, ValueError, FileExistsError, FileNotFoundError)


def _train(config, checked) -> int:
    from megatron_rl.observability.run_log import setup_process_logging

    # First: the imports below warn (megatron-core without Apex/TE); the notices go to the file.
    setup_process_logging(config.run_dir / "logs" / "driver.log")
    # Imported here: the trainer pulls in Ray, megatron-core and transformers.
    from ray.exceptions import RayActorError

    from megatron_rl.actor.checkpoint.save_load import NonFiniteWeightsError
    from megatron_rl.cli import reaper
    from megatron_rl.loop.pipeline import make_trainer
    from megatron_rl.loop.trainer import NonFiniteStepsError
    from megatron_rl.rewards import AllRewardsFailedError

    # Lives until this process has exited (Ray's own shutdown at exit included) and then ends
    # whatever the run left behind: the net under a driver killed outright.
    reaper.start()
    try:
        trainer = make_trainer(config, checked=checked)
    except _BAD_INPUT as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        trainer.run()
    except (NonFiniteStepsError, NonFiniteWeightsError, AllRewardsFailedError) as e:
        # Raised inside a Ray actor, the error arrives wrapped; its cause is the message.
        print(f"error: step {trainer.step}: {getattr(e, 'cause', None) or e}", file=sys.stderr)
        return EXIT_FAILURE
    except RayActorError as e:  # a rank killed from outside (OOM killer, a node lost): resumable
        print(
            f"error: step {trainer.step}: a process of the run died ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:200]}); rerun the same command to resume from the last checkpoint",
            file=sys.stderr,
        )
        return EXIT_FAILURE
    finally:
        trainer.close()
    saved = any((config.run_dir / "checkpoints").glob("step_*"))
    print(
        f"done: metrics in {config.run_dir / 'metrics.jsonl'}"
        + (f", checkpoints in {config.run_dir / 'checkpoints'}" if saved else ", no checkpoint (trainer.save_final)")
        + f", logs in {config.run_dir / 'logs'}; plot with: python tools/plot_run.py {config.run_dir}",
        file=sys.stderr,
    )
    return EXIT_OK
