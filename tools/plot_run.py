#!/usr/bin/env python
"""Plot a run: ``python tools/plot_run.py RUN_DIR [--out DIR]`` writes PNGs (reward,
accuracy per group, gradient share by p_old quartile and fixed bucket, and the AR/Lopti
paper's Figure 1 layout: token_quartiles.png) to RUN_DIR/plots."""

import argparse
import sys

from megatron_rl.observability.plots import plot_run


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="run directory holding metrics.jsonl")
    parser.add_argument("--out", default=None, help="output directory (default RUN_DIR/plots)")
    args = parser.parse_args(argv)
    try:
        paths = plot_run(args.run_dir, args.out)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for p in paths:
        print(p)
    if not paths:
        print("error: no plottable metrics in metrics.jsonl", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
