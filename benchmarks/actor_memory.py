#!/usr/bin/env python
"""Peak memory of one actor train step, measured, side by side (JSON lines).

    python benchmarks/actor_memory.py                 # the comparison below, one process per case
    python benchmarks/actor_memory.py --case JSON     # one case (what the comparison runs)
    torchrun --nproc_per_node 2 benchmarks/actor_memory.py --case JSON   # a TP/PP case

The comparison uses the Qwen2.5 vocabulary (151,936 rows) and a few thousand tokens per
micro-batch: the materialised-logits loss vs the fused lm-head loss, each with the
reference policy resident and offloaded. Each case runs in a fresh process and reports,
for the ``train_step`` after ``warmup_steps`` (1 in the comparison: the first step
allocates Adam's moments; 0 for the planner check, whose plan includes them), the peak resident
memory of the rank that needs most (a thread in each rank samples ``/proc/self/statm``
every half millisecond) minus its memory before the model was built (after megatron's
process groups were set up), and the peak the
step adds on top of what was resident before it (activations, loss buffers, optimizer
temporaries: where the loss paths differ), and the bytes the reference's parameters hold on the device between its
passes. On a CPU host memory is device memory: offloading keeps the same bytes in the
process (so the process peak does not move); what it changes is what the device holds,
which is what the report's ``reference_resident_parameter_bytes`` counts.

``tests/distributed/test_planner.py`` runs ``--case`` to check the memory planner.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

QWEN25_VOCAB = 151_936
DEFAULT_CASE = {
    "hidden": 512, "ffn": 1408, "layers": 2, "heads": 8, "kv_heads": 2, "vocab": QWEN25_VOCAB, "tie": False,
    "tp": 1, "pp": 1, "sp": False, "dtype": "float32", "loss_impl": "fused_linear", "recompute": "none",
    "seq_len": 512, "seqs": 4, "reference": "none", "chunk_tokens": None, "warmup_steps": 1, "lora_rank": 0,
}  # fmt: skip


class PeakRSS:
    """Samples this process's resident memory in a thread; ``peak`` while active."""

    def __init__(self, interval_s: float = 0.0005):
        self.interval_s = interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE")

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def __enter__(self) -> PeakRSS:
        self.peak = self.rss()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(self.interval_s)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())


@contextmanager
def _mark_before_optimizer_step(probe: PeakRSS):
    """Record the sampler's peak when the optimizer step starts: the forward-backward's peak.

    Benchmark instrumentation of our own module: ``actor.optimizer_step`` is wrapped for
    the duration of the block only."""
    import megatron_rl.actor.actor as actor_module

    original, marks = actor_module.optimizer_step, {"peak": 0}

    def marked(*args, **kwargs):
        marks["peak"] = max(probe.peak, probe.rss())
        return original(*args, **kwargs)

    actor_module.optimizer_step = marked
    try:
        yield marks
    finally:
        actor_module.optimizer_step = original


def hf_config(case: dict) -> dict:
    """A Qwen2 config of the case's shape, or with ``experts`` > 0 a Qwen3-MoE one (every MLP
    ``experts`` experts of width ``expert_ffn``, ``topk`` per token)."""
    cfg = {
        "model_type": "qwen2", "hidden_size": case["hidden"], "intermediate_size": case["ffn"],
        "num_hidden_layers": case["layers"], "num_attention_heads": case["heads"],
        "num_key_value_heads": case["kv_heads"], "vocab_size": case["vocab"], "max_position_embeddings": 8192,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": case["tie"],
    }  # fmt: skip
    if case.get("experts"):
        cfg.update(model_type="qwen3_moe", head_dim=case["hidden"] // case["heads"], num_experts=case["experts"],
                   num_experts_per_tok=case["topk"], moe_intermediate_size=case["expert_ffn"], norm_topk_prob=True)  # fmt: skip
    return cfg


def spec_of(case: dict, world: int):
    from megatron_rl.actor.spec import ActorSpec
    from megatron_rl.algo import AlgorithmConfig
    from megatron_rl.config.model import ModelOptions
    from megatron_rl.config.parallel import ParallelConfig
    from megatron_rl.config.rollout import RolloutConfig
    from megatron_rl.config.trainer import ActorConfig, LoRAConfig, TrainerConfig

    tokens = case["seq_len"] * case["seqs"]
    lora = LoRAConfig(rank=case["lora_rank"]) if case.get("lora_rank") else None
    return ActorSpec(
        architecture=hf_config(case),
        model=ModelOptions(dtype=case["dtype"]),
        parallel=ParallelConfig(num_actor_ranks=world, tensor_model_parallel_size=case["tp"],
                                pipeline_model_parallel_size=case["pp"], sequence_parallel=case["sp"]),
        trainer=TrainerConfig(lr=1e-6, max_tokens_per_microbatch=tokens),
        actor=ActorConfig(loss_impl=case["loss_impl"], recompute_granularity=case["recompute"],
                          reference_offload=case["reference"] == "offloaded", logits_chunk_tokens=case["chunk_tokens"],
                          lora=lora),
        algorithm=AlgorithmConfig(kl_coef=0.001 if case["reference"] != "none" else 0.0),
        rollout=RolloutConfig(num_prompts_per_step=case["seqs"], num_samples_per_prompt=world // (case["tp"] * case["pp"]),
                              max_prompt_tokens=16, max_new_tokens=case["seq_len"] - 16),
    )  # fmt: skip


def run_case(case: dict) -> dict:
    """Build the actor (and reference), run one train step, measure; rank 0's report."""
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):  # fmt: skip
        os.environ.setdefault(key, value)
    import torch
    import torch.distributed as dist

    from megatron_rl.actor.actor import MegatronActor
    from megatron_rl.actor.batch import ActorBatch
    from megatron_rl.actor.launch import destroy_process_groups, init_process_group, initialize_parallel
    from megatron_rl.actor.reference import ReferencePolicy

    probe = PeakRSS()
    init_process_group()
    torch.set_num_threads(1)
    world = dist.get_world_size()
    spec = spec_of(case, world)
    # The baseline follows megatron's process groups: with gloo each group's communicator
    # costs host memory (about 230 MiB per rank at TP=1 PP=2), which is the process's, not
    # the model state's the planner predicts (NCCL's buffers are not modelled either).
    groups = initialize_parallel(tensor_model_parallel_size=case["tp"], pipeline_model_parallel_size=case["pp"])
    baseline = probe.rss()
    actor = MegatronActor(spec, groups=groups)
    reference = None
    if case["reference"] != "none":
        reference = ReferencePolicy(spec, groups=actor.groups)
        reference.copy_weights_from(actor)
    n = case["seqs"] * actor.groups.dp_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, case["vocab"], (n, case["seq_len"]), generator=g)
    attn = torch.ones_like(ids)
    loss_mask = attn.clone()
    loss_mask[:, :16] = 0
    batch = ActorBatch(input_ids=ids, attention_mask=attn, loss_mask=loss_mask)
    old = actor.compute_logprobs(batch).logp
    ref_logp = reference.compute_logprobs(batch).logp if reference is not None else None
    batch = ActorBatch(input_ids=ids, attention_mask=attn, loss_mask=loss_mask, old_logp=old, ref_logp=ref_logp,
                       advantages=torch.randn(n, 1, generator=g).expand_as(old).clone())  # fmt: skip
    resident = probe.rss()
    # Adam allocates its moments on the first step, whatever its batch: the warm-up steps
    # train on a short slice (one sequence per data-parallel rank) so that the measured step
    # is most of the case's compute.
    rows, cols = actor.groups.dp_size, min(case["seq_len"], 32)
    warmup = ActorBatch(input_ids=ids[:rows, :cols], attention_mask=attn[:rows, :cols],
                        loss_mask=loss_mask[:rows, :cols], old_logp=old[:rows, :cols],
                        ref_logp=None if ref_logp is None else ref_logp[:rows, :cols],
                        advantages=batch.advantages[:rows, :cols])  # fmt: skip
    for _ in range(case["warmup_steps"]):
        actor.train_step(warmup)
    before_step = probe.rss()
    dist.barrier()
    start = time.perf_counter()
    with PeakRSS() as step, _mark_before_optimizer_step(step) as marks:
        actor.train_step(batch)
    seconds = time.perf_counter() - start
    mine = (resident - baseline, step.peak - baseline, step.peak - before_step, marks["peak"] - before_step)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    report = {
        "benchmark": "actor_memory",
        "case": case,
        "world": world,
        "tokens_per_microbatch": case["seq_len"] * case["seqs"],
        "baseline_rss_bytes": baseline,
        "after_build_bytes": max(m[0] for m in everyone),
        "train_step_peak_bytes": max(m[1] for m in everyone),  # the rank that needs most
        "train_step_peak_bytes_per_rank": [m[1] for m in everyone],
        # what the step adds on top of the resident state (activations, loss buffers,
        # optimizer temporaries), and what its forward-backward alone adds (activations and
        # loss buffers: where the two loss paths differ)
        "train_step_transient_peak_bytes": max(m[2] for m in everyone),
        "forward_backward_transient_peak_bytes": max(m[3] for m in everyone),
        "train_step_seconds": round(seconds, 3),
        "reference_resident_parameter_bytes": reference.resident_parameter_bytes() if reference is not None else 0,
    }
    destroy_process_groups()
    return report


def launch(case: dict, *, timeout_s: float = 1800, ranks_launcher: list[str] | None = None) -> dict:
    """Run ``case`` in a fresh process (several ranks: see :func:`launch_case`); rank 0's report."""
    return launch_case(Path(__file__), case, world=case["tp"] * case["pp"], benchmark="actor_memory",
                       timeout_s=timeout_s, ranks_launcher=ranks_launcher)  # fmt: skip


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
"""The default command that starts ``world`` ranks of a script (followed by ``world``)."""


def launch_case(script: Path, case: dict, *, world: int, benchmark: str, timeout_s: float, env=None,
                ranks_launcher: list[str] | None = None) -> dict:  # fmt: skip
    """Run ``script --case JSON`` in fresh processes and return the last JSON line rank 0
    printed for ``benchmark``. Several ranks (``world`` > 1) are started by
    ``ranks_launcher + [world]`` (default :data:`TORCHRUN`; any command that gives each rank
    torchrun's environment, such as the tests' launcher that forks them after shared imports)."""
    args = [str(Path(script).resolve()), "--case", json.dumps(case)]
    if world > 1:
        cmd = [*(ranks_launcher or TORCHRUN), str(world), *args]
    else:
        cmd = [sys.executable, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"case {case} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}")
    lines = [line for line in proc.stdout.splitlines() if line.startswith(f'{{"benchmark": "{benchmark}"')]
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", help="run one case (JSON of DEFAULT_CASE's keys) in this process")
    parser.add_argument("--tokens", type=int, nargs=2, default=(512, 4), metavar=("SEQ_LEN", "SEQS"),
                        help="sequence length and sequences per micro-batch of the comparison (default 512 4)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.case:
        report = run_case({**DEFAULT_CASE, **json.loads(args.case)})
        if int(os.environ.get("RANK", "0")) == 0:
            print(json.dumps(report), flush=True)
        return 0
    seq_len, seqs = args.tokens
    for loss_impl in ("logits", "fused_linear"):
        for reference in ("resident", "offloaded"):
            case = {**DEFAULT_CASE, "loss_impl": loss_impl, "reference": reference, "seq_len": seq_len, "seqs": seqs}
            print(json.dumps(launch(case)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
