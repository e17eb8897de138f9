"""PNG plots of a run from its ``metrics.jsonl``: reward, accuracy per group, and the
token-probability diagnostics (``diagnostics.py``). Uses matplotlib's Agg backend.

The diagnostics are averaged over bins of consecutive steps (per-step values are noisy
once many groups have zero advantage), without ever carrying a stale value forward:

- a group's ``mean_p``/``dp_mean`` in a bin is the token-weighted mean over the bin's
  steps where the group had tokens; a bin where it had none is a gap (NaN);
- a group's gradient share in a bin is the mean of its per-step shares over the bin's
  steps that had a gradient, counting an empty group's share as its true 0, so the
  shares of a bin sum to 1; a group empty in every such step is a gap (NaN), which
  still leaves the others summing to 1. Steps with no gradient at all
  (``tokens/logit_grad_norm_sum == 0``) or without diagnostics are left out.

:func:`binned_shares` and :func:`binned_means` compute exactly what is drawn.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from megatron_rl.observability.diagnostics import (
    BUCKET_GROUPS,
    GRAD_NORM_SUM_KEY,
    QUARTILE_GROUPS,
    TokenGroup,
)
from megatron_rl.observability.metrics import read_metrics

ACCURACY_KEY = re.compile(r"^eval/accuracy/(?P<group>[^/]+)/(?P<mode>greedy|sampled)$")

NUM_BINS = 40
"""Default number of step bins for the diagnostics plots."""

Record = Mapping[str, Any]


def series(records: Sequence[Record], key: str) -> tuple[list[int], list[float]]:
    """``(steps, values)`` of the records that hold a non-null ``key``."""
    pts = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [p[0] for p in pts], [float(p[1]) for p in pts]


def bin_size(records: Sequence[Record], num_bins: int = NUM_BINS) -> int:
    """Steps per bin so that a run makes about ``num_bins`` bins (at least 1)."""
    steps = [r["step"] for r in records]
    return max(1, math.ceil((max(steps) - min(steps) + 1) / num_bins)) if steps else 1


def _bins(records: Sequence[Record], width: int) -> list[tuple[float, list[Record]]]:
    """Records grouped into bins of ``width`` consecutive steps: ``(bin centre step, records)``."""
    grouped: dict[int, list[Record]] = {}
    for r in records:
        grouped.setdefault((int(r["step"]) - 1) // width, []).append(r)
    return [(b * width + (width + 1) / 2, rs) for b, rs in sorted(grouped.items())]


def _has_gradient(r: Record, groups: Sequence[TokenGroup]) -> bool:
    total = r.get(GRAD_NORM_SUM_KEY)
    return total is not None and total > 0 and all(r.get(f"{g.prefix}/grad_share") is not None for g in groups)


def binned_shares(
    records: Sequence[Record], groups: Sequence[TokenGroup], width: int
) -> tuple[list[float], list[list[float]]]:
    """Gradient share of each group per bin: ``(bin centres, shares[bin][group])``.

    NaN marks a group with no tokens in any of the bin's steps with a gradient; the
    non-NaN shares of a bin sum to 1 (module docstring). Bins without a step with a
    gradient are left out.
    """
    centres, rows = [], []
    for centre, rs in _bins([r for r in records if _has_gradient(r, groups)], width):
        row = []
        for g in groups:
            present = any((r.get(f"{g.prefix}/count") or 0) > 0 for r in rs)
            row.append(sum(r[f"{g.prefix}/grad_share"] for r in rs) / len(rs) if present else math.nan)
        centres.append(centre)
        rows.append(row)
    return centres, rows


def binned_means(
    records: Sequence[Record], groups: Sequence[TokenGroup], field: str, width: int
) -> tuple[list[float], list[list[float]]]:
    """Token-weighted mean of ``field`` (``mean_p``, ``dp_mean``) per group and bin.

    Returns ``(bin centres, values[bin][group])``; NaN where the group had no tokens in
    the bin (its logged 0 is a placeholder, never drawn). Bins without diagnostics are
    left out.
    """
    keyed = [r for r in records if any(r.get(f"{g.prefix}/{field}") is not None for g in groups)]
    centres, rows = [], []
    for centre, rs in _bins(keyed, width):
        row = []
        for g in groups:
            n = v = 0.0
            for r in rs:
                c, x = r.get(f"{g.prefix}/count") or 0.0, r.get(f"{g.prefix}/{field}")
                if c > 0 and x is not None:
                    n, v = n + c, v + c * x
            row.append(v / n if n > 0 else math.nan)
        centres.append(centre)
        rows.append(row)
    return centres, rows


def _column(rows: list[list[float]], k: int) -> list[float]:
    return [row[k] for row in rows]


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write ``reward.png``, ``accuracy.png``, ``grad_share.png`` and ``token_quartiles.png``
    (those with data). Returns the paths written. ``out_dir`` defaults to ``run_dir/plots``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    records = read_metrics(run_dir / "metrics.jsonl")
    out = Path(out_dir) if out_dir is not None else run_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def save(fig, name):
        path = out / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    steps, reward = series(records, "rollout/reward/mean")
    if steps:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(steps, reward, label="mean reward")
        for key, style in (("rollout/reward/max", ":"), ("rollout/reward/min", ":")):
            s, v = series(records, key)
            if s:
                ax.plot(s, v, style, label=key.rsplit("/", 1)[1])
        ax.set_xlabel("step")
        ax.set_ylabel("reward")
        ax.set_title(f"reward: {run_dir.name}")
        ax.legend()
        save(fig, "reward.png")

    acc_keys = sorted({k for r in records for k in r if ACCURACY_KEY.match(k)})
    if acc_keys:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for key in acc_keys:
            m = ACCURACY_KEY.match(key)
            s, v = series(records, key)
            ax.plot(s, v, "-o" if m["mode"] == "greedy" else "--", ms=3, label=f"{m['group']} {m['mode']}")
        ax.set_xlabel("step")
        ax.set_ylabel("accuracy")
        ax.set_ylim(-0.02, 1.02)
        ax.set_title("eval accuracy per group")
        ax.legend(fontsize=7, ncol=2)
        save(fig, "accuracy.png")

    width = bin_size(records)
    if any(_has_gradient(r, QUARTILE_GROUPS) for r in records):
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.5), sharey=True)
        for ax, groups, title in (
            (axes[0], QUARTILE_GROUPS, "by quartile of p_old (equal-count)"),
            (axes[1], BUCKET_GROUPS, "by fixed range of p_old"),
        ):
            x, rows = binned_shares(records, groups, width)
            for k, g in enumerate(groups):
                ax.plot(x, _column(rows, k), "-o", ms=2, label=g.label)  # NaN: a gap
            ax.set_xlabel("step")
            ax.set_title(title, fontsize=10)
            ax.set_ylim(0, 1)
            ax.legend(fontsize=7)
        axes[0].set_ylabel(f"share of logit-gradient norm\n(mean over {width} steps)")
        save(fig, "grad_share.png")
        save(figure1(records, width=width, title=run_dir.name), "token_quartiles.png")
    return written


def figure1(records: Sequence[Record], *, width: int, title: str = ""):
    """The AR/Lopti paper's Figure 1 layout, over training: (a) each quartile's share of
    the logit-gradient norm (stacked: the bars sum to 1), (b) each quartile's mean
    probability change after the update. Returns the matplotlib figure."""
    import matplotlib.pyplot as plt

    fig, (ax_share, ax_dp) = plt.subplots(1, 2, figsize=(10, 3.6))
    x, shares = binned_shares(records, QUARTILE_GROUPS, width)
    bottom = [0.0] * len(x)
    colors = plt.get_cmap("viridis")([0.05, 0.35, 0.65, 0.9])
    for k, g in enumerate(QUARTILE_GROUPS):
        h = [0.0 if math.isnan(v) else v for v in _column(shares, k)]  # an empty quartile adds nothing
        ax_share.bar(x, h, width=width * 0.9, bottom=bottom, color=colors[k], label=g.label)
        bottom = [b + v for b, v in zip(bottom, h)]
    ax_share.set_ylim(0, 1)
    ax_share.set_xlabel("step")
    ax_share.set_ylabel("share of logit-gradient norm")
    ax_share.set_title("(a) gradient share per p_old quartile", fontsize=10)
    ax_share.legend(fontsize=7, loc="lower right")
    x, dps = binned_means(records, QUARTILE_GROUPS, "dp_mean", width)
    for k, g in enumerate(QUARTILE_GROUPS):
        ax_dp.plot(x, _column(dps, k), "-o", ms=2, color=colors[k], label=g.label)
    ax_dp.axhline(0.0, color="grey", lw=0.6)
    ax_dp.set_xlabel("step")
    ax_dp.set_ylabel("mean p_new - p_old")
    ax_dp.set_title("(b) probability change after the update", fontsize=10)
    ax_dp.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig
