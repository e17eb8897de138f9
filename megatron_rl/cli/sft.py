"""``megatron-rl sft``: supervised fine-tuning of the actor on prompt/response rows (the warm
start an RL run takes as ``model.checkpoint``).

    megatron-rl sft CONFIG [section.field=value ...] [--dry-run]

The config is an :class:`~megatron_rl.config.sft.SFTRunConfig` (``docs/sft_config.md``).
Start, stop and exit codes are ``megatron-rl train``'s (:mod:`.train`): the pre-flight
(:func:`megatron_rl.loop.sft.sft_preflight`) checks everything before a process starts
(exit 2 on a bad input), a signal stops the run after the step in progress with a
checkpoint (exit 3; rerun to continue), a failure is one ``error:`` line (exit 1).
"""

from __future__ import annotations

import argparse

from megatron_rl.cli.train import RunKind, add_arguments, launch

__all__ = ["SFT", "add_arguments", "run"]


def _load(path: str, overrides: list[str]):
    from megatron_rl.config.sft import load_sft_config

    return load_sft_config(path, overrides)


def _preflight(config, renamed: dict[str, str]):
    from megatron_rl.loop.sft import sft_preflight

    return sft_preflight(config)


def _trainer(config, checked):
    from megatron_rl.loop.sft import SFTTrainer

    return SFTTrainer(config, checked=checked)


def _summary(config) -> str:
    par, data = config.parallel, config.data
    return (
        f"actor: {par.num_actor_ranks} rank(s) = TP {par.tensor_model_parallel_size} x "
        f"PP {par.pipeline_model_parallel_size} x DP {par.resolved_data_parallel_size}\n"
        f"batch: {data.rows_per_step} rows per optimizer step, rows up to {data.max_sequence_tokens} tokens"
    )


SFT = RunKind(load=_load, preflight=_preflight, make_trainer=_trainer, summary=_summary)
"""``megatron-rl sft``."""


def run(args: argparse.Namespace) -> int:
    """Validate the SFT config, then train or (``--dry-run``) print and save it; returns the exit code."""
    return launch(args, SFT)
