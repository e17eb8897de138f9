"""Metrics sink (JSONL + Weights & Biases), progress line, token-probability diagnostics, plots."""

from megatron_rl.observability.diagnostics import (
    PROB_BUCKET_EDGES,
    token_probability_diagnostics,
)
from megatron_rl.observability.metrics import MetricsSink, read_metrics
from megatron_rl.observability.progress import ProgressLine
from megatron_rl.observability.rollout_metrics import rollout_metrics

__all__ = [
    "PROB_BUCKET_EDGES",
    "MetricsSink",
    "ProgressLine",
    "read_metrics",
    "rollout_metrics",
    "token_probability_diagnostics",
]
