"""``megatron-rl sweep``: train one config with several methods x seeds, then compare them.

    megatron-rl sweep CONFIG --methods grpo,ar,lopti,ar_lopti,stapo,tr_grpo --seeds 3
                      [--out DIR] [--threshold 0.9] [--threshold-key KEY] [--threshold-window N]
                      [--tail-fraction F] [--dry-run]
                      [--launcher local [--jobs N] | slurm [--sbatch-args '...'] [--sbatch-script F]
                      [--poll-s S]] [section.field=value ...]

Each run is ``megatron-rl train CONFIG`` with, in this order: the method's preset
(below), the user's overrides (which apply to every run and so win over a preset), and
the run's own ``trainer.seed``, ``trainer.output_dir = OUT/<method>`` and
``logging.run_name = seed<S>``. Seeds are ``trainer.seed + i`` for ``i < --seeds``.
Where the runs go (``--launcher``):

- ``local`` (default; a CPU machine, one node): each run in its own process (a clean Ray
  and megatron state), ``--jobs`` at a time (default 1: one after the other), started in
  plan order. Runs at once need cores of their own: each run's engine and actor use
  torch's threads, so on a small machine runs at once are slower than one after the other
  (measured in docs/trainer.md). A run refused as a bad config (exit code 2) starts no
  further run (the running ones finish) and the sweep exits with that code.
- ``slurm`` (a cluster): every run is its own job, ``sbatch [--sbatch-args] SCRIPT CONFIG
  OVERRIDES`` with ``SCRIPT`` = ``slurm/train.sbatch`` (a Ray cluster over the job's
  nodes, the trainer as its driver; docs/multinode.md), all submitted at once, so they
  run side by side as far as the cluster has room. The sweep then polls the jobs'
  states (``scontrol``; ``sacct`` for a job the controller has already forgotten) every
  ``--poll-s`` seconds until every job has ended. A job that exits 2 cancels the
  sweep's other jobs (they share the bad config) and the sweep exits 2; Ctrl-C cancels
  the jobs still queued or running. Job logs: ``OUT/logs/<method>_seed<S>-<job id>.log``.
  ``OUT`` and CONFIG are passed as absolute paths; other paths in the config are
  relative to the submit directory, as for any ``train.sbatch`` job.

A run whose ``metrics.jsonl`` already reaches ``trainer.num_steps`` is not run again; an
interrupted one is started again and, with ``trainer.resume: auto``, continues from its
latest checkpoint if it wrote one. Then ``OUT/comparison.{md,json,png}``
(``observability/comparison.py``) are written from the runs that produced metrics.

Method presets come from the paper configs, so no method setting is written twice: the
preset of method ``M`` is every ``algorithm`` field that ``M_3b.yaml`` sets differently
from ``grpo_3b.yaml`` in ``--methods-dir`` (default ``examples/kk_logic``), e.g.
``ar`` -> ``algorithm.ar.alpha=0.2``; ``stapo`` -> its ``stapo`` section plus
``eps_high=0.28`` and ``kl_coef=0.0``. The shared settings (clip, KL, ...) stay those of
CONFIG. A preset must turn on exactly the registered token-weight methods its name
joins (``ar_lopti`` -> ``ar`` and ``lopti``; ``grpo`` -> none): this is checked before
any run starts.

A method may name a variant: ``METHOD:FIELD=VALUE[:FIELD=VALUE...]`` runs ``METHOD``'s
preset plus ``algorithm.FIELD=VALUE`` (before the user's overrides), under its own label,
which is also its directory: ``tr_grpo:tr_grpo.placement=loss`` beside ``tr_grpo`` compares
TR-GRPO's two placements in one sweep.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_rl.cli import EXIT_FAILURE, EXIT_OK, EXIT_USAGE
from megatron_rl.config.lib import ConfigError

BASELINE = "grpo"
"""The method with no token-weight method; its paper config is the presets' reference, and
the comparison tests every other method against it."""

PAPER_CONFIG_SUFFIX = "_3b.yaml"
"""Presets are read from ``<methods-dir>/<method>_3b.yaml``."""

DEFAULT_METHODS = "grpo,ar,lopti,ar_lopti,stapo,tr_grpo"

LAUNCHERS = ("local", "slurm")


def _repo_path(*parts: str) -> Path:
    # The repository's file next to the package (editable install), else the working
    # directory's (running from a checkout).
    beside = Path(__file__).resolve().parents[2].joinpath(*parts)
    return beside if beside.exists() else Path(*parts)


def _default_methods_dir() -> Path:
    return _repo_path("examples", "kk_logic")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``sweep`` arguments."""
    parser.add_argument("config", metavar="CONFIG", help="the base run config YAML (see docs/config.md)")
    parser.add_argument(
        "overrides", nargs="*", metavar="section.field=value", help="overrides applied to every run (values are YAML)"
    )
    parser.add_argument(
        "--methods",
        default=DEFAULT_METHODS,
        help=f"comma-separated methods, each METHOD or METHOD:FIELD=VALUE[:...] (a variant: algorithm.FIELD=VALUE "
        f"on top of the method's preset) (default: {DEFAULT_METHODS})",
    )
    parser.add_argument("--seeds", type=int, default=3, help="seeds per method: trainer.seed + 0 .. N-1 (default: 3)")
    parser.add_argument("--out", default=None, help="sweep directory (default: <trainer.output_dir>/<run_name>_sweep)")
    parser.add_argument(
        "--threshold-key", default="eval/accuracy/mean", help="metric of 'steps to threshold' (default: %(default)s)"
    )
    parser.add_argument("--threshold", type=float, default=0.9, help="its threshold (default: %(default)s)")
    parser.add_argument(
        "--threshold-window",
        type=int,
        default=1,
        help="compare the mean of the metric's last N logged values with the threshold (smooths a per-step "
        "metric such as rollout/reward/mean) (default: %(default)s: the value itself)",
    )
    parser.add_argument(
        "--tail-fraction",
        type=float,
        default=0.1,
        help="final reward and entropy: means over this last fraction of the steps (default: %(default)s)",
    )
    parser.add_argument(
        "--methods-dir",
        default=None,
        help="directory of the paper configs <method>_3b.yaml (default: examples/kk_logic)",
    )
    parser.add_argument("--dry-run", action="store_true", help="validate and print the runs; train nothing")
    parser.add_argument(
        "--jobs", type=int, default=1, help="runs at a time on this machine (local; default: %(default)s)"
    )
    parser.add_argument(
        "--launcher",
        choices=LAUNCHERS,
        default="local",
        help="local: one run after the other on this machine; slurm: each run its own sbatch job, "
        "all submitted at once (default: %(default)s)",
    )
    parser.add_argument(
        "--sbatch-args",
        default="",
        help="sbatch flags for every job, one shell-quoted string after '=' (slurm), e.g. "
        "--sbatch-args='--nodes=1 --partition=gpu'",
    )
    parser.add_argument(
        "--sbatch-script",
        default=None,
        help="job script taking CONFIG [overrides] (slurm; default: slurm/train.sbatch)",
    )
    parser.add_argument(
        "--poll-s", type=float, default=30.0, help="seconds between polls of the jobs' states (slurm; default: 30)"
    )


# --------------------------------------------------------------------------- presets


def _flatten(tree: Any, prefix: str) -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(_flatten(value, f"{prefix}.{key}"))
    return out


def _algorithm_fields(path: Path) -> dict[str, Any]:
    import yaml

    if not path.is_file():
        raise ConfigError("--methods", f"no paper config {path} for this method")
    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    return _flatten(data.get("algorithm") or {}, "algorithm")


def method_preset(method: str, methods_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``algorithm`` fields (dotted key -> value) of ``method``'s paper config that
    differ from the GRPO paper config's (module docstring)."""
    methods_dir = Path(methods_dir)
    base = _algorithm_fields(methods_dir / f"{BASELINE}{PAPER_CONFIG_SUFFIX}")
    fields = _algorithm_fields(methods_dir / f"{method}{PAPER_CONFIG_SUFFIX}")
    return {key: value for key, value in fields.items() if key not in base or base[key] != value}


def preset_overrides(preset: dict[str, Any]) -> list[str]:
    """``key=value`` overrides (values as JSON, which YAML reads back unchanged)."""
    return [f"{key}={json.dumps(value)}" for key, value in preset.items()]


def parse_method(spec: str) -> tuple[str, list[str]]:
    """``METHOD[:FIELD=VALUE...]`` -> ``(METHOD, ["algorithm.FIELD=VALUE", ...])`` (module
    docstring). Raises :class:`ConfigError` for a variant part that is not ``FIELD=VALUE``."""
    method, *parts = spec.split(":")
    for part in parts:
        field, eq, _ = part.partition("=")
        if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", field):
            raise ConfigError("--methods", f"{spec!r}: {part!r} is not FIELD=VALUE (a field of the algorithm section)")
    if not method:
        raise ConfigError("--methods", f"{spec!r} names no method before ':'")
    return method, [f"algorithm.{part}" for part in parts]


def expected_methods(method: str, registered: list[str]) -> set[str]:
    """The registered token-weight methods a sweep method's name joins with ``_``.

    ``grpo`` -> none; ``ar_lopti`` -> {ar, lopti}; ``tr_grpo`` -> {tr_grpo}. Raises
    :class:`ConfigError` for a name that is not such a join.
    """
    if method == BASELINE:
        return set()
    alternatives = "|".join(re.escape(n) for n in sorted(registered, key=len, reverse=True))
    if not re.fullmatch(rf"(?:{alternatives})(?:_(?:{alternatives}))*", method):
        raise ConfigError(
            "--methods", f"{method!r} is neither {BASELINE!r} nor registered methods joined by '_' ({registered})"
        )
    return set(re.findall(rf"(?:^|_)({alternatives})(?=_|$)", method))


# --------------------------------------------------------------------------- runs

Run = tuple[str, int, list[str]]
"""``(method, seed, overrides)`` of one planned run."""


def _is_complete(run_dir: Path, num_steps: int) -> bool:
    from megatron_rl.observability import read_metrics

    path = run_dir / "metrics.jsonl"
    return path.is_file() and any(int(r.get("step") or 0) >= num_steps for r in read_metrics(path))


def plan_runs(args: argparse.Namespace) -> tuple[Path, list[Run], Any]:
    """Validate everything; returns ``(sweep dir, [(method, seed, overrides)], base config)``."""
    from megatron_rl.algo import TOKEN_WEIGHT_METHODS
    from megatron_rl.algo.methods.compose import enabled_methods
    from megatron_rl.config.run import load_run_config

    if args.seeds < 1:
        raise ConfigError("--seeds", f"must be >= 1, got {args.seeds}")
    if args.jobs < 1:
        raise ConfigError("--jobs", f"must be >= 1, got {args.jobs}")
    if args.threshold_window < 1:
        raise ConfigError("--threshold-window", f"must be >= 1, got {args.threshold_window}")
    if not 0 < args.tail_fraction <= 1:
        raise ConfigError("--tail-fraction", f"must be in (0, 1], got {args.tail_fraction}")
    if args.jobs > 1 and args.launcher != "local":
        raise ConfigError("--jobs", f"applies to --launcher local; the {args.launcher} launcher runs every job at once")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods or len(set(methods)) != len(methods):
        raise ConfigError("--methods", f"needs distinct method names, got {args.methods!r}")
    if args.launcher == "slurm":
        _check_slurm(args)
    base = load_run_config(args.config, args.overrides)
    out = Path(args.out) if args.out else Path(base.trainer.output_dir) / f"{base.logging.run_name}_sweep"
    if args.launcher == "slurm":
        out = out.resolve()  # a job may start in another directory (sbatch --chdir)
    methods_dir = Path(args.methods_dir) if args.methods_dir else _default_methods_dir()
    registered = TOKEN_WEIGHT_METHODS.names()
    runs = []
    for method in methods:
        name, variant = parse_method(method)
        preset = [*preset_overrides(method_preset(name, methods_dir)), *variant]
        for i in range(args.seeds):
            seed = base.trainer.seed + i
            own = [f"trainer.seed={seed}", f"trainer.output_dir={out / method}", f"logging.run_name=seed{seed}"]
            overrides = [*preset, *args.overrides, *own]
            config = load_run_config(args.config, overrides)
            got = {m.name for m in enabled_methods(config.algorithm)}
            if got != expected_methods(name, registered):
                raise ConfigError(
                    "--methods", f"{method!r} runs with token-weight methods {sorted(got)} (preset {preset}, "
                    f"overrides {args.overrides}); expected {sorted(expected_methods(name, registered))}"
                )  # fmt: skip
            runs.append((method, seed, overrides))
    return out, runs, base


def run(args: argparse.Namespace) -> int:
    """Plan, run each method x seed (``--launcher``), write the comparison; returns the exit code."""
    from megatron_rl.observability.comparison import RunLabel, write_comparison

    # Names resolved through registries (task, estimator, model type) and data files are
    # checked by each run's own `train` start-up; a run refused that way (exit 2) stops
    # the sweep, since every other run shares the cause.
    out, runs, base = plan_runs(args)
    if args.dry_run:
        for method, seed, overrides in runs:
            print(f"{method} seed {seed}: {' '.join(_command(args, out, method, seed, overrides))}")
        print(f"dry run: {len(runs)} runs into {out}", file=sys.stderr)
        return EXIT_OK
    out.mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    labels, todo = [], []
    for k, (method, seed, overrides) in enumerate(runs, 1):
        run_dir = out / method / f"seed{seed}"
        labels.append(RunLabel(method=method, seed=seed, run_dir=str(run_dir)))
        if _is_complete(run_dir, base.trainer.num_steps):
            print(f"[{k}/{len(runs)}] {method} seed {seed}: complete, kept", file=sys.stderr)
        else:
            todo.append((k, (method, seed, overrides)))
    launch = _run_slurm if args.launcher == "slurm" else _run_local
    code, failed = launch(args, out, todo, len(runs), base.trainer.num_steps)
    if code is not None:
        return code
    done = [lb for lb in labels if (Path(lb.run_dir) / "metrics.jsonl").is_file()]
    if not done:
        print("error: no run produced metrics; " + "; ".join(failed), file=sys.stderr)
        return EXIT_FAILURE
    compared = (f"--threshold-key {args.threshold_key} --threshold {args.threshold:g} "
                f"--threshold-window {args.threshold_window} --tail-fraction {args.tail_fraction:g}")  # fmt: skip
    header = "Runs: `megatron-rl sweep " + " ".join([args.config, *args.overrides]) + f" --methods {args.methods} "
    header += f"--seeds {args.seeds} {compared}`" + (f"\n\nFailed: {'; '.join(failed)}" if failed else "")
    paths = write_comparison(out, done, threshold_key=args.threshold_key, threshold=args.threshold,
                             threshold_window=args.threshold_window, tail_fraction=args.tail_fraction, header=header,
                             baseline=BASELINE)  # fmt: skip
    print((out / "comparison.md").read_text(encoding="utf-8"))
    for p in paths:
        print(f"wrote {p}", file=sys.stderr)
    if failed:
        print("error: failed runs: " + "; ".join(failed), file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_OK


def _command(args: argparse.Namespace, out: Path, method: str, seed: int, overrides: list[str]) -> list[str]:
    """The command line of one run: ``python -m megatron_rl train ...``, or its ``sbatch`` call."""
    if args.launcher == "slurm":
        return [
            "sbatch", "--parsable", f"--job-name=mrl-{method}-s{seed}",
            f"--output={out / 'logs' / f'{method}_seed{seed}'}-%j.log", *shlex.split(args.sbatch_args),
            str(_sbatch_script(args)), str(Path(args.config).resolve()), *overrides,
        ]  # fmt: skip
    return [sys.executable, "-m", "megatron_rl", "train", args.config, *overrides]


def _run_local(
    args: argparse.Namespace, out: Path, todo: list[tuple[int, Run]], total: int, num_steps: int
) -> tuple[int | None, list[str]]:
    """Each run in its own process, ``args.jobs`` at a time, started in plan order. Returns
    ``(exit code to stop with, or None; failed runs)``. Ctrl-C kills the running ones."""
    failed: list[str] = []
    queue = list(todo)
    running: dict[subprocess.Popen, tuple[str, int, Path, float, Any]] = {}
    refused = False
    try:
        while running or (queue and not refused):
            while queue and not refused and len(running) < args.jobs:
                k, (method, seed, overrides) = queue.pop(0)
                log = out / "logs" / f"{method}_seed{seed}.log"
                print(f"[{k}/{total}] {method} seed {seed}: training (log {log})", file=sys.stderr, flush=True)
                f = open(log, "w", encoding="utf-8")  # noqa: SIM115 (closed when the run ends)
                proc = subprocess.Popen(_command(args, out, method, seed, overrides), stdout=f, stderr=subprocess.STDOUT)
                running[proc] = (method, seed, log, time.perf_counter(), f)
            ended = [proc for proc in running if proc.poll() is not None]
            if not ended:
                time.sleep(LOCAL_POLL_S)
            for proc in ended:
                method, seed, log, start, f = running.pop(proc)
                f.close()
                code = proc.returncode
                print(f"    {method} seed {seed}: exit {code} after {time.perf_counter() - start:.0f} s", file=sys.stderr)
                if code == EXIT_USAGE:
                    print(f"error: {method} seed {seed} was refused (bad config or data); see {log}", file=sys.stderr)
                    refused = True
                elif code != 0:
                    failed.append(f"{method} seed {seed} (exit {code}, see {log})")
    except KeyboardInterrupt:
        for proc, (*_, f) in running.items():
            proc.kill()
            proc.wait()
            f.close()
        raise
    return (EXIT_USAGE if refused else None), failed


LOCAL_POLL_S = 0.2
"""Seconds between checks of the local runs' processes."""


# --------------------------------------------------------------------------- slurm

ENDED_STATES = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
     "DEADLINE", "REVOKED", "SPECIAL_EXIT"}
)  # fmt: skip
"""Slurm job states after which the job will not run again (a requeued job is PENDING)."""

SLURM_CALL_TIMEOUT_S = 120
"""Limit of one ``sbatch``/``scontrol``/``sacct``/``scancel`` call."""

MAX_FAILED_POLLS = 20
"""Consecutive polls in which the controller could not be asked before the sweep gives up."""


def _sbatch_script(args: argparse.Namespace) -> Path:
    return Path(args.sbatch_script).resolve() if args.sbatch_script else _repo_path("slurm", "train.sbatch").resolve()


def _check_slurm(args: argparse.Namespace) -> None:
    for tool in ("sbatch", "scontrol", "scancel"):
        if shutil.which(tool) is None:
            raise ConfigError("--launcher", f"slurm needs {tool!r} on PATH; none found")
    if not _sbatch_script(args).is_file():
        raise ConfigError("--sbatch-script", f"no job script {_sbatch_script(args)}")
    if not args.poll_s > 0:
        raise ConfigError("--poll-s", f"must be > 0, got {args.poll_s}")
    try:
        shlex.split(args.sbatch_args)
    except ValueError as e:
        raise ConfigError("--sbatch-args", f"cannot be split as shell words: {e}") from None


def _call(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=False, timeout=SLURM_CALL_TIMEOUT_S)


@dataclass(frozen=True)
class JobEnd:
    """How a Slurm job ended."""

    state: str
    """Its final state (``COMPLETED``, ``FAILED``, ...)."""
    exit_code: int
    """The job script's exit code; 1 for a job that ended in another state than
    ``COMPLETED`` with code 0 (killed by a signal, cancelled, out of time)."""


def _job_end(state: str, code: int) -> JobEnd:
    return JobEnd(state=state, exit_code=1 if state != "COMPLETED" and code == 0 else code)


class _PollError(Exception):
    """The controller could not be asked this time (not a fact about the job)."""


def job_end(job_id: str, *, finished_run: bool) -> JobEnd | None:
    """How job ``job_id`` ended, or ``None`` while it is queued or running.

    Asks ``scontrol show job``; a job it no longer knows (purged after ``MinJobAge``)
    is looked up with ``sacct``, and without accounting judged by its run:
    ``finished_run`` (its metrics reach ``trainer.num_steps``) counts as COMPLETED.
    Raises :class:`_PollError` when the controller cannot be reached.
    """
    try:
        proc = _call(["scontrol", "show", "job", "-o", job_id])
    except subprocess.TimeoutExpired as e:
        raise _PollError(f"scontrol timed out after {e.timeout} s") from None
    if proc.returncode == 0:
        state = re.search(r"\bJobState=(\S+)", proc.stdout)
        if state is None:
            raise _PollError(f"scontrol printed no JobState for job {job_id}: {proc.stdout.strip()[:200]}")
        if state.group(1) not in ENDED_STATES:
            return None
        code = re.search(r"\bExitCode=(\d+):", proc.stdout)
        return _job_end(state.group(1), int(code.group(1)) if code else 1)
    if "invalid job id" not in (proc.stderr + proc.stdout).lower():
        raise _PollError(f"scontrol failed: {(proc.stderr or proc.stdout).strip()[:300]}")
    if shutil.which("sacct") is not None:
        try:
            acct = _call(["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "State,ExitCode"])
        except subprocess.TimeoutExpired as e:
            raise _PollError(f"sacct timed out after {e.timeout} s") from None
        line = acct.stdout.strip().splitlines()[0] if acct.returncode == 0 and acct.stdout.strip() else ""
        if "|" in line:
            state, code = line.split("|", 1)
            state = state.split()[0] if state.split() else "UNKNOWN"  # "CANCELLED by 0"
            if state in ENDED_STATES:
                return _job_end(state, int(code.split(":")[0]) if code.split(":")[0].isdigit() else 1)
    return JobEnd(state="COMPLETED", exit_code=0) if finished_run else JobEnd(state="UNKNOWN", exit_code=1)


def _cancel(job_ids: list[str]) -> None:
    if job_ids:
        proc = _call(["scancel", *job_ids])
        note = "" if proc.returncode == 0 else f" (scancel: {proc.stderr.strip()[:200]})"
        print(f"cancelled job(s) {' '.join(job_ids)}{note}", file=sys.stderr)


def _run_slurm(
    args: argparse.Namespace, out: Path, todo: list[tuple[int, Run]], total: int, num_steps: int
) -> tuple[int | None, list[str]]:
    """Every run as its own sbatch job, submitted at once; wait for all. Returns
    ``(exit code to stop with, or None; failed runs)``."""
    pending: dict[str, tuple[str, int, Path]] = {}  # job id -> (method, seed, log), until it ends
    failed: list[str] = []
    try:
        for k, (method, seed, overrides) in todo:
            cmd = _command(args, out, method, seed, overrides)
            proc = _call(cmd)
            if proc.returncode != 0:
                print(f"error: sbatch refused {method} seed {seed}: {proc.stderr.strip()}", file=sys.stderr)
                _cancel(list(pending))
                return EXIT_FAILURE, failed
            job_id = proc.stdout.strip().split(";")[0]  # "ID;cluster" on a federation
            log = out / "logs" / f"{method}_seed{seed}-{job_id}.log"
            pending[job_id] = (method, seed, log)
            print(f"[{k}/{total}] {method} seed {seed}: job {job_id} (log {log})", file=sys.stderr, flush=True)
        failed_polls = 0
        while pending:
            try:
                ends = {}
                for job_id, (method, seed, _) in pending.items():
                    run_dir = out / method / f"seed{seed}"
                    ends[job_id] = job_end(job_id, finished_run=_is_complete(run_dir, num_steps))
                failed_polls = 0
            except _PollError as e:
                failed_polls += 1
                if failed_polls >= MAX_FAILED_POLLS:
                    print(f"error: cannot ask Slurm about the jobs ({e}); still running: {' '.join(pending)}",
                          file=sys.stderr)  # fmt: skip
                    return EXIT_FAILURE, failed
                ends = {}
            for job_id, end in ends.items():
                if end is None:
                    continue
                method, seed, log = pending.pop(job_id)
                print(f"    job {job_id} ({method} seed {seed}): {end.state}, exit {end.exit_code}", file=sys.stderr)
                if end.exit_code == EXIT_USAGE:
                    print(f"error: {method} seed {seed} was refused (bad config or data); see {log}", file=sys.stderr)
                    _cancel(list(pending))
                    return EXIT_USAGE, failed
                if end.exit_code != 0:
                    failed.append(f"{method} seed {seed} (job {job_id} {end.state}, exit {end.exit_code}, see {log})")
            if pending:
                time.sleep(args.poll_s)
    except KeyboardInterrupt:
        _cancel(list(pending))  # queued or running: a later sweep starts them again
        raise
    return None, failed


__all__ = [
    "JobEnd", "add_arguments", "expected_methods", "job_end", "method_preset", "parse_method", "plan_runs", "run",
]  # fmt: skip
