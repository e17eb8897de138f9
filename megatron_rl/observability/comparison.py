"""Compare runs of several methods over seeds: a table (Markdown + JSON) and a figure.

Input: run directories (each with a ``metrics.jsonl``), labelled by method and seed, as
``megatron-rl sweep`` writes them. Per run (:func:`summarize_run`):

- ``final_accuracy``: the last logged ``eval/accuracy/mean`` (greedy eval accuracy);
  ``final_sampled_accuracy``: the last ``eval/accuracy/mean/sampled`` (one response per
  prompt at the rollout temperature), where the evaluation logs it;
- ``steps_to_threshold``: the first logged step whose ``threshold_key`` (default
  ``eval/accuracy/mean``) reaches ``threshold``, as the mean of its last
  ``threshold_window`` logged values (1: the value itself; more smooth a per-step metric
  such as the training reward, which one lucky batch would otherwise cross); ``None``
  when it never does;
- ``final_reward`` / ``final_entropy``: the mean of ``rollout/reward/mean`` /
  ``loss/entropy`` over the last ``tail_fraction`` of the logged steps (at least one);
- ``low_quartile_grad_share``: the mean over the run's steps with a gradient of
  ``tokens/quartile_q1/grad_share``, the lowest-probability quarter's share of the
  logit-gradient norm (the AR/Lopti paper's Figure 1 quantity);
- ``start_quartile_mean_p`` / ``start_quartile_grad_share``: the four ``p_old``
  quartiles' mean probability (q1 lowest) at the first logged step, and their shares of
  the logit-gradient norm at the first step with a gradient: the regime the run starts
  in (after SFT the lowest quartile's mean p sits far above ``1/V``; at random init it
  is about ``1/V``);
- ``wall_s``: seconds from the first to the last logged step.

Per method (:func:`aggregate`): the mean over seeds and its standard error
``s / sqrt(n)`` (``s`` the sample standard deviation, ``n - 1`` degrees of freedom;
``None`` for one seed). ``steps_to_threshold`` is averaged over the seeds that reached
the threshold, and how many did is reported beside it. Given a baseline method (the
sweep's ``grpo``), each other method's final accuracies and final reward are tested against
the baseline's with Welch's two-sided t-test over seeds (unequal variances; ``None`` with
fewer than two seeds on either side or no variance on both).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from scipy import stats

from megatron_rl.observability.diagnostics import GRAD_NORM_SUM_KEY, QUARTILE_GROUPS
from megatron_rl.observability.metrics import read_metrics
from megatron_rl.observability.plots import NUM_BINS, series

ACCURACY_KEY = "eval/accuracy/mean"
SAMPLED_ACCURACY_KEY = "eval/accuracy/mean/sampled"
REWARD_KEY = "rollout/reward/mean"
ENTROPY_KEY = "loss/entropy"
LOW_SHARE_KEY = f"{QUARTILE_GROUPS[0].prefix}/grad_share"


@dataclass(frozen=True, kw_only=True)
class RunLabel:
    """One run of a comparison."""

    method: str
    """The method's name (``grpo``, ``ar``, ...)."""
    seed: int
    """``trainer.seed`` of the run."""
    run_dir: str
    """The run directory (holds ``metrics.jsonl``)."""


@dataclass(frozen=True, kw_only=True)
class RunSummary:
    """The compared numbers of one run (module docstring); ``None`` where the run has no data."""

    method: str
    """The method's name."""
    seed: int
    """``trainer.seed``."""
    run_dir: str
    """The run directory."""
    last_step: int
    """The last logged step."""
    final_accuracy: float | None
    """The last logged ``eval/accuracy/mean``."""
    final_sampled_accuracy: float | None
    """The last logged ``eval/accuracy/mean/sampled``."""
    steps_to_threshold: int | None
    """First step whose threshold metric (mean of its last ``threshold_window`` values)
    reached the threshold."""
    final_reward: float | None
    """Mean ``rollout/reward/mean`` over the last ``tail_fraction`` of steps."""
    final_entropy: float | None
    """Mean ``loss/entropy`` (nats) over the last ``tail_fraction`` of steps."""
    low_quartile_grad_share: float | None
    """Mean share of the logit-gradient norm from the lowest ``p_old`` quartile."""
    start_quartile_mean_p: list[float] | None
    """Mean ``p_old`` of quartiles q1..q4 (q1 lowest) at the first logged step."""
    start_quartile_grad_share: list[float] | None
    """Gradient shares of quartiles q1..q4 at the first step with a gradient."""
    wall_s: float
    """Seconds from the first to the last logged step."""


@dataclass(frozen=True, kw_only=True)
class Stat:
    """A mean over seeds with its standard error."""

    mean: float | None
    """Mean over the values (``None`` without values)."""
    se: float | None
    """Standard error ``s / sqrt(n)``; ``None`` with fewer than two values."""
    values: list[float] = field(default_factory=list)
    """The values it summarises (seeds with data only)."""

    @classmethod
    def of(cls, values: Sequence[float | None]) -> Stat:
        vals = [float(v) for v in values if v is not None]
        if not vals:
            return cls(mean=None, se=None, values=[])
        se = statistics.stdev(vals) / math.sqrt(len(vals)) if len(vals) > 1 else None
        return cls(mean=statistics.fmean(vals), se=se, values=vals)

    def text(self, digits: int = 3) -> str:
        if self.mean is None:
            return "n/a"
        return f"{self.mean:.{digits}f}" + (f" ± {self.se:.{digits}f}" if self.se is not None else "")


def _tail_mean(records: Sequence[dict[str, Any]], key: str, tail_fraction: float) -> float | None:
    _, values = series(records, key)
    if not values:
        return None
    n = max(1, math.ceil(len(values) * tail_fraction))
    return statistics.fmean(values[-n:])


def _first_step_reaching(records: Sequence[dict[str, Any]], key: str, threshold: float, window: int) -> int | None:
    steps, values = series(records, key)
    for i in range(window - 1, len(values)):
        if statistics.fmean(values[i - window + 1 : i + 1]) >= threshold:
            return int(steps[i])
    return None


def _quartiles_at_start(records: Sequence[dict[str, Any]], name: str, *, need_gradient: bool) -> list[float] | None:
    keys = [f"{g.prefix}/{name}" for g in QUARTILE_GROUPS]
    for r in records:
        if all(r.get(k) is not None for k in keys) and (not need_gradient or (r.get(GRAD_NORM_SUM_KEY) or 0) > 0):
            return [float(r[k]) for k in keys]
    return None


def summarize_run(
    label: RunLabel,
    *,
    threshold_key: str = ACCURACY_KEY,
    threshold: float = 0.9,
    threshold_window: int = 1,
    tail_fraction: float = 0.1,
) -> RunSummary:
    """The :class:`RunSummary` of one run directory (module docstring)."""
    if threshold_window < 1:
        raise ValueError(f"threshold_window must be >= 1, got {threshold_window}")
    records = read_metrics(Path(label.run_dir) / "metrics.jsonl")
    _, acc = series(records, ACCURACY_KEY)
    _, sampled = series(records, SAMPLED_ACCURACY_KEY)
    shares = [
        r[LOW_SHARE_KEY] for r in records if (r.get(GRAD_NORM_SUM_KEY) or 0) > 0 and r.get(LOW_SHARE_KEY) is not None
    ]
    return RunSummary(
        method=label.method,
        seed=label.seed,
        run_dir=str(label.run_dir),
        last_step=int(records[-1]["step"]) if records else 0,
        final_accuracy=acc[-1] if acc else None,
        final_sampled_accuracy=sampled[-1] if sampled else None,
        steps_to_threshold=_first_step_reaching(records, threshold_key, threshold, threshold_window),
        final_reward=_tail_mean(records, REWARD_KEY, tail_fraction),
        final_entropy=_tail_mean(records, ENTROPY_KEY, tail_fraction),
        low_quartile_grad_share=statistics.fmean(shares) if shares else None,
        start_quartile_mean_p=_quartiles_at_start(records, "mean_p", need_gradient=False),
        start_quartile_grad_share=_quartiles_at_start(records, "grad_share", need_gradient=True),
        wall_s=float(records[-1]["time"] - records[0]["time"]) if len(records) > 1 else 0.0,
    )


@dataclass(frozen=True, kw_only=True)
class MethodSummary:
    """A method's numbers over its seeds."""

    method: str
    """The method's name."""
    seeds: list[int]
    """The seeds summarised."""
    final_accuracy: Stat
    """Final (greedy) eval accuracy over seeds."""
    final_sampled_accuracy: Stat
    """Final sampled eval accuracy over seeds (no values where the evaluation logs none)."""
    steps_to_threshold: Stat
    """Steps to the threshold, over the seeds that reached it."""
    num_reached: int
    """Seeds that reached the threshold."""
    final_reward: Stat
    """Final training reward over seeds."""
    final_entropy: Stat
    """Final policy entropy over seeds."""
    low_quartile_grad_share: Stat
    """Lowest-quartile gradient share over seeds."""
    start_q1_mean_p: Stat
    """The lowest quartile's mean ``p_old`` at the first step, over seeds."""
    start_q1_grad_share: Stat
    """The lowest quartile's gradient share at the first step with a gradient, over seeds."""
    wall_s: Stat
    """Run wall time over seeds."""
    accuracy_p_value: float | None
    """Welch's two-sided p-value of final accuracy against the baseline method's."""
    sampled_accuracy_p_value: float | None
    """Welch's two-sided p-value of final sampled accuracy against the baseline method's."""
    reward_p_value: float | None
    """Welch's two-sided p-value of final reward against the baseline method's."""
    accuracy_delta: PairedDelta | None = None
    """Final accuracy minus the baseline's, paired by seed (``None``: no baseline, or the
    baseline itself)."""
    sampled_accuracy_delta: PairedDelta | None = None
    """Final sampled accuracy minus the baseline's, paired by seed."""


@dataclass(frozen=True, kw_only=True)
class PairedDelta:
    """A method's difference from the baseline over the seeds both ran: runs of one seed
    start alike (the same prompts in the same order, the same sampling seeds), so the
    seed-to-seed spread cancels in the difference."""

    delta: Stat
    """Mean ± standard error of ``method - baseline`` over the paired seeds."""
    p_value: float | None
    """Two-sided paired t-test (``scipy.stats.ttest_rel``); ``None`` with fewer than two pairs
    or differences that are all equal."""

    def text(self) -> str:
        d = self.delta
        if d.mean is None:
            return "n/a"
        se = f" ± {d.se:.3f}" if d.se is not None else ""
        return f"{d.mean:+.3f}{se} (p {_p_text(self.p_value)})"


def paired_delta(method: Sequence[tuple[int, float | None]], base: Sequence[tuple[int, float | None]]) -> PairedDelta:
    """``method - base`` paired by seed, from ``(seed, value)`` pairs (seeds with a value on
    both sides only)."""
    theirs = {seed: v for seed, v in base if v is not None}
    pairs = [(v, theirs[seed]) for seed, v in method if v is not None and seed in theirs]
    delta = Stat.of([a - b for a, b in pairs])
    p = None
    # Differences equal up to rounding (0.41 - 0.30 vs 0.45 - 0.34) have no variance to test.
    if len(pairs) >= 2 and max(delta.values) - min(delta.values) > 1e-9:
        p = float(stats.ttest_rel([a for a, _ in pairs], [b for _, b in pairs]).pvalue)
    return PairedDelta(delta=delta, p_value=p)


def welch_p_value(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Two-sided p-value of Welch's t-test (unequal variances) of ``a`` against ``b``;
    ``None`` with fewer than two values on a side or no variance on both."""
    if len(a) < 2 or len(b) < 2 or (statistics.variance(a) == 0 and statistics.variance(b) == 0):
        return None
    return float(stats.ttest_ind(a, b, equal_var=False).pvalue)


def _welch(runs: Sequence[RunSummary], base: Sequence[RunSummary], field_name: str) -> float | None:
    """:func:`welch_p_value` of ``field_name`` of ``runs`` against ``base``; ``None`` without a base."""
    if not base:
        return None
    return welch_p_value(*(Stat.of([getattr(r, field_name) for r in rs]).values for rs in (runs, base)))


def _paired(runs: Sequence[RunSummary], base: Sequence[RunSummary], field_name: str) -> PairedDelta | None:
    """:func:`paired_delta` of ``field_name`` of ``runs`` against ``base``; ``None`` without a base."""
    if not base:
        return None
    return paired_delta(*([(r.seed, getattr(r, field_name)) for r in rs] for rs in (runs, base)))


def _with_sampled(methods: Sequence[MethodSummary]) -> bool:
    """Whether some run logged the sampled accuracy (its columns and notes are shown then)."""
    return any(m.final_sampled_accuracy.values for m in methods)


def _q1(quartiles: list[float] | None) -> float | None:
    return quartiles[0] if quartiles else None


def aggregate(summaries: Sequence[RunSummary], *, baseline: str | None = None) -> list[MethodSummary]:
    """One :class:`MethodSummary` per method, in order of first appearance; p-values against
    ``baseline`` where it is among the methods (``None`` for the baseline itself, and for
    every method without a baseline)."""
    methods = list(dict.fromkeys(s.method for s in summaries))
    base = [s for s in summaries if s.method == baseline]
    out = []
    for m in methods:
        runs = [s for s in summaries if s.method == m]
        steps = [s.steps_to_threshold for s in runs]
        against = base if m != baseline else []  # the baseline is not tested against itself
        out.append(
            MethodSummary(
                method=m,
                seeds=[s.seed for s in runs],
                final_accuracy=Stat.of([s.final_accuracy for s in runs]),
                final_sampled_accuracy=Stat.of([s.final_sampled_accuracy for s in runs]),
                steps_to_threshold=Stat.of(steps),
                num_reached=sum(v is not None for v in steps),
                final_reward=Stat.of([s.final_reward for s in runs]),
                final_entropy=Stat.of([s.final_entropy for s in runs]),
                low_quartile_grad_share=Stat.of([s.low_quartile_grad_share for s in runs]),
                start_q1_mean_p=Stat.of([_q1(s.start_quartile_mean_p) for s in runs]),
                start_q1_grad_share=Stat.of([_q1(s.start_quartile_grad_share) for s in runs]),
                wall_s=Stat.of([s.wall_s for s in runs]),
                accuracy_p_value=_welch(runs, against, "final_accuracy"),
                sampled_accuracy_p_value=_welch(runs, against, "final_sampled_accuracy"),
                reward_p_value=_welch(runs, against, "final_reward"),
                accuracy_delta=_paired(runs, against, "final_accuracy"),
                sampled_accuracy_delta=_paired(runs, against, "final_sampled_accuracy"),
            )
        )
    return out


def _p_text(p: float | None) -> str:
    return "-" if p is None else f"{p:.3f}"


def comparison_markdown(
    methods: Sequence[MethodSummary],
    *,
    threshold_key: str,
    threshold: float,
    threshold_window: int = 1,
    baseline: str | None = None,
) -> str:
    """The comparison table as Markdown (means ± standard errors over seeds; the p-values
    against ``baseline``, as :func:`aggregate` computed them, and the differences from it paired
    by seed, when one is given). The sampled accuracy gets its columns when some run logged it."""
    with_sampled = _with_sampled(methods)
    window = f" (mean of {threshold_window} values)" if threshold_window > 1 else ""
    header = ["method", "seeds", "final accuracy", f"steps to {threshold_key}{window} >= {threshold:g} (reached)",
              "final reward", "final entropy", "q1 gradient share", "q1 mean p at start",
              "q1 gradient share at start", "wall s/run"]  # fmt: skip
    if with_sampled:
        header.insert(3, "final sampled accuracy")
    p_column = header.index("final reward")  # after the steps to the threshold
    if baseline:
        deltas = [("accuracy_delta", f"accuracy - {baseline}, paired by seed")]
        if with_sampled:
            deltas.append(("sampled_accuracy_delta", f"sampled accuracy - {baseline}, paired by seed"))
        tested = "accuracy / sampled / reward" if with_sampled else "accuracy / reward"
        header[p_column:p_column] = [f"p vs {baseline} ({tested})"] + [title for _, title in deltas]
    rows = [header]
    for m in methods:
        steps = m.steps_to_threshold
        steps_text = (
            (f"{steps.mean:.0f}" + (f" ± {steps.se:.0f}" if steps.se is not None else ""))
            if steps.mean is not None
            else "-"
        )
        row = [m.method, str(len(m.seeds)), m.final_accuracy.text(), f"{steps_text} ({m.num_reached}/{len(m.seeds)})",
               m.final_reward.text(), m.final_entropy.text(), m.low_quartile_grad_share.text(),
               m.start_q1_mean_p.text(), m.start_q1_grad_share.text(), m.wall_s.text(0)]  # fmt: skip
        p_values = [m.accuracy_p_value, m.reward_p_value]
        if with_sampled:
            row.insert(3, m.final_sampled_accuracy.text())
            p_values.insert(1, m.sampled_accuracy_p_value)
        if baseline:
            paired = [getattr(m, name) for name, _ in deltas]
            row[p_column:p_column] = [" / ".join(_p_text(p) for p in p_values)] + [
                "-" if d is None else d.text() for d in paired
            ]
        rows.append(row)
    lines = ["| " + " | ".join(cells) + " |" for cells in rows]
    lines.insert(1, "|" + "---|" * len(header))
    return "\n".join(lines) + "\n"


def write_comparison(
    out_dir: str | Path,
    labels: Sequence[RunLabel],
    *,
    threshold_key: str = ACCURACY_KEY,
    threshold: float = 0.9,
    threshold_window: int = 1,
    tail_fraction: float = 0.1,
    header: str = "",
    baseline: str | None = None,
) -> list[Path]:
    """Write ``comparison.md``, ``comparison.json`` and ``comparison.png`` to ``out_dir``.

    ``header`` (Markdown) goes above the table (e.g. the command that produced the runs);
    ``baseline``: the method the others are tested against (:func:`aggregate`).
    Returns the paths written.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = [summarize_run(lb, threshold_key=threshold_key, threshold=threshold, threshold_window=threshold_window,
                          tail_fraction=tail_fraction) for lb in labels]  # fmt: skip
    methods = aggregate(runs, baseline=baseline)
    table = comparison_markdown(methods, threshold_key=threshold_key, threshold=threshold,
                                threshold_window=threshold_window, baseline=baseline)  # fmt: skip
    sampled = f"; final sampled accuracy: the last `{SAMPLED_ACCURACY_KEY}`" if _with_sampled(methods) else ""
    window = f", the first step where the mean of its last {threshold_window} values reaches it" \
        if threshold_window > 1 else ""  # fmt: skip
    notes = [
        "Means ± standard errors over seeds.",
        f"Final accuracy: the last `{ACCURACY_KEY}` (greedy){sampled}; final reward and entropy: means over the "
        f"last {tail_fraction:.0%} of steps; q1 gradient share: the lowest-p_old quartile's share of the "
        "logit-gradient norm, averaged over the steps with a gradient; steps to the threshold: over the seeds "
        f"that reached it{window}.",
        "q1 at start: the lowest-p_old quartile's mean p at the first step and its gradient share at the first "
        "step with a gradient.",
    ]
    if baseline:
        notes.append(f"p vs {baseline}: Welch's two-sided t-test over seeds of the final accuracies and final reward. "
                     f"Paired by seed: the mean ± standard error of the difference from {baseline}'s run of the same "
                     "seed (same prompts, same sampling seeds) and the paired t-test's two-sided p.")  # fmt: skip
    md = out_dir / "comparison.md"
    md.write_text(
        (header.rstrip() + "\n\n" if header else "") + table + "\n" + " ".join(notes) + "\n", encoding="utf-8"
    )
    js = out_dir / "comparison.json"
    payload = {
        "threshold_key": threshold_key,
        "threshold": threshold,
        "threshold_window": threshold_window,
        "tail_fraction": tail_fraction,
        "methods": [asdict(m) for m in methods],
        "runs": [asdict(r) for r in runs],
    }
    js.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    png = plot_comparison(labels, out_dir / "comparison.png")
    return [md, js, png]


def _binned_seed_mean(
    per_seed: Sequence[Sequence[dict[str, Any]]], key: str, width: int, *, require_gradient: bool = False
) -> tuple[list[float], list[float], list[float]]:
    """``(bin centres, mean over seeds, standard error)`` of ``key`` averaged per bin of steps."""
    bins: dict[int, list[float]] = {}
    for records in per_seed:
        seed_bins: dict[int, list[float]] = {}
        for r in records:
            v = r.get(key)
            if v is None or (require_gradient and not (r.get(GRAD_NORM_SUM_KEY) or 0) > 0):
                continue
            seed_bins.setdefault((int(r["step"]) - 1) // width, []).append(float(v))
        for b, vs in seed_bins.items():
            bins.setdefault(b, []).append(statistics.fmean(vs))
    x, mean, se = [], [], []
    for b in sorted(bins):
        stat = Stat.of(bins[b])
        x.append(b * width + (width + 1) / 2)
        mean.append(stat.mean)
        se.append(stat.se or 0.0)
    return x, mean, se


MIN_EVALS_FOR_CURVES = 3
"""Fewer evaluations per run than this (a study that evaluates once, at the end) and the
accuracy panel shows each method's final accuracies instead of curves (:func:`final_accuracies`)."""


def final_accuracies(per_seed: Sequence[Sequence[dict[str, Any]]], key: str) -> list[float]:
    """The last logged ``key`` of each run that logged it (one value per seed)."""
    finals = []
    for records in per_seed:
        values = [r[key] for r in records if r.get(key) is not None]
        if values:
            finals.append(float(values[-1]))
    return finals


def _plot_final_accuracies(ax: Any, runs: dict[str, list[list[dict[str, Any]]]]) -> None:
    """One column per method: each seed's final greedy accuracy (filled dots) and sampled
    accuracy (hollow, where logged), the mean ± standard error as a bar beside them."""
    for i, (method, per_seed) in enumerate(runs.items()):
        for key, dx, fill in ((ACCURACY_KEY, -0.12, True), (SAMPLED_ACCURACY_KEY, 0.12, False)):
            finals = final_accuracies(per_seed, key)
            if not finals:
                continue
            stat = Stat.of(finals)
            color = f"C{i % 10}"
            ax.scatter([i + dx] * len(finals), finals, s=14, color=color if fill else "none", edgecolors=color)
            ax.errorbar([i + dx + 0.06], [stat.mean], yerr=[stat.se or 0.0], fmt="_", color=color, capsize=3)
    ax.set_xticks(range(len(runs)), [f"{m} (n={len(r)})" for m, r in runs.items()], rotation=25, ha="right",
                  fontsize=7)  # fmt: skip
    ax.set_xlim(-0.5, len(runs) - 0.5)


def plot_comparison(labels: Sequence[RunLabel], path: str | Path) -> Path:
    """Eval accuracy, training reward, entropy and the lowest quartile's gradient share over
    training, one line per method (mean over seeds, band = ± standard error); with fewer
    than :data:`MIN_EVALS_FOR_CURVES` evaluations per run, the final accuracies per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs: dict[str, list[list[dict[str, Any]]]] = {}
    for lb in labels:
        runs.setdefault(lb.method, []).append(read_metrics(Path(lb.run_dir) / "metrics.jsonl"))
    last = max((r[-1]["step"] for rs in runs.values() for r in rs if r), default=1)
    width = max(1, math.ceil(last / NUM_BINS))
    panels = (
        (ACCURACY_KEY, "eval accuracy (greedy)", 1, False),  # evals fall on the same steps in every seed
        (REWARD_KEY, "training reward", width, False),
        (ENTROPY_KEY, "policy entropy (nats)", width, False),
        (LOW_SHARE_KEY, "gradient share of the lowest p_old quartile", width, True),
    )
    evals = max((sum(r.get(ACCURACY_KEY) is not None for r in rs) for per in runs.values() for rs in per), default=0)
    final_panel = 0 < evals < MIN_EVALS_FOR_CURVES  # the accuracy panel without curves: the legend moves
    fig, axes = plt.subplots(2, 2, figsize=(10, 6.5))
    for ax, (key, title, w, grad_only) in zip(axes.flat, panels):
        if key == ACCURACY_KEY and final_panel:
            _plot_final_accuracies(ax, runs)
            ax.set_title("final eval accuracy: greedy (filled), sampled (hollow); mean ± s.e.", fontsize=10)
            ax.set_ylim(bottom=0)
            continue
        for method, per_seed in runs.items():
            x, mean, se = _binned_seed_mean(per_seed, key, w, require_gradient=grad_only)
            if not x:
                continue
            (line,) = ax.plot(x, mean, "-", lw=1.4, label=f"{method} (n={len(per_seed)})")
            ax.fill_between(x, [m - s for m, s in zip(mean, se)], [m + s for m, s in zip(mean, se)],
                            color=line.get_color(), alpha=0.2, lw=0)  # fmt: skip
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        if key in (ACCURACY_KEY, LOW_SHARE_KEY):
            ax.set_ylim(-0.02, 1.02)
    axes.flat[1 if final_panel else 0].legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
