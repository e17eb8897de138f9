"""PNG plots of a run from its ``metrics.jsonl``: reward, accuracy per group, and the
token-probability buckets' gradient shares. Uses matplotlib's Agg backend (no display)."""

from __future__ import annotations

import re
from pathlib import Path

from megatron_rl.observability.metrics import read_metrics

ACCURACY_KEY = re.compile(r"^eval/accuracy/(?P<group>[^/]+)/(?P<mode>greedy|sampled)$")


def _series(records, key):
    pts = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def _smooth(values, window):
    """Trailing moving average (per-step shares are noisy once many groups have zero advantage)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v - (values[i - window] if i >= window else 0.0)
        out.append(acc / min(i + 1, window))
    return out


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write ``reward.png``, ``accuracy.png`` and ``grad_share.png`` (those with data).

    Returns the paths written. ``out_dir`` defaults to ``run_dir/plots``.
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

    steps, reward = _series(records, "rollout/reward/mean")
    if steps:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(steps, reward, label="mean reward")
        for key, style in (("rollout/reward/max", ":"), ("rollout/reward/min", ":")):
            s, v = _series(records, key)
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
            s, v = _series(records, key)
            ax.plot(s, v, "-o" if m["mode"] == "greedy" else "--", ms=3, label=f"{m['group']} {m['mode']}")
        ax.set_xlabel("step")
        ax.set_ylabel("accuracy")
        ax.set_ylim(-0.02, 1.02)
        ax.set_title("eval accuracy per group")
        ax.legend(fontsize=7, ncol=2)
        save(fig, "accuracy.png")

    share_keys = [f"tokens/prob_q{k}/grad_share" for k in range(1, 5)]
    if any(_series(records, k)[0] for k in share_keys):
        fig, ax = plt.subplots(figsize=(6, 3.5))
        labels = ["p<.25", ".25-.5", ".5-.75", ">=.75"]
        window = max(1, len(records) // 50)
        for key, label in zip(share_keys, labels):
            s, v = _series(records, key)
            if s:
                ax.plot(s, _smooth(v, window), label=label)
        ax.set_xlabel("step")
        ax.set_ylabel(f"share of logit-gradient norm\n(moving average of {window})" if window > 1 else "share of logit-gradient norm")
        ax.set_ylim(0, 1)
        ax.set_title("gradient share by p_old bucket")
        ax.legend(fontsize=8)
        save(fig, "grad_share.png")
    return written
