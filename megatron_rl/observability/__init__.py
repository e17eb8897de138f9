"""Metrics sink (JSONL + Weights & Biases), progress line, token-probability diagnostics, plots."""

from megatron_rl.observability.diagnostics import (
    BUCKET_GROUPS,
    PROB_BUCKET_EDGES,
    QUARTILE_GROUPS,
    TokenGroup,
    quartile_index,
    token_probability_diagnostics,
)
from megatron_rl.observability.metrics import MetricsSink, read_metrics
from megatron_rl.observability.progress import ProgressLine
from megatron_rl.observability.rollout_metrics import rollout_metrics

__all__ = [
    "BUCKET_GROUPS",
    "PROB_BUCKET_EDGES",
    "QUARTILE_GROUPS",
    "TokenGroup",
    "MetricsSink",
    "ProgressLine",
    "read_metrics",
    "quartile_index",
    "rollout_metrics",
    "token_probability_diagnostics",
]
