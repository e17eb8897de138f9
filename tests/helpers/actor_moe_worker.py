"""torchrun worker for tests/distributed/test_actor_moe.py: the mixture-of-experts actor at
expert, tensor and pipeline parallelism on CPU/gloo, in ONE 2-rank job.

Usage::

    torchrun --standalone --nproc_per_node 2 tests/helpers/actor_moe_worker.py SPEC.json OUT_DIR

``SPEC.json``: ``{"variants": {"qwen3_moe": {"hf_dir", ...}}}``. Each rank writes
``OUT_DIR/rank<r>.json``. Megatron imports stay under the ``__main__`` guard.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.helpers.actor_scale_worker import PROMPT, L, N
from tests.helpers.actor_scale_worker import make_batch as scale_batch
from tests.helpers.routing_replay_cases import run_cases

AUX_COEFF = 0.05
"""Larger than Qwen3-MoE's 0.001, so that the load-balancing term moves the weights visibly."""


def make_batch(vocab: int, *, uneven: bool = False):
    """The scale tests' batch, or with ``uneven`` one whose even rows (data-parallel rank
    0's) are long and odd rows short, so that rank 0 needs more micro-batches."""
    import torch

    lengths = torch.tensor([L if i % 2 == 0 else PROMPT + 3 for i in range(N)]) if uneven else None
    return scale_batch(vocab, lengths=lengths)


def run(spec: dict) -> dict:
    from dataclasses import replace
    from functools import partial

    import torch
    import torch.distributed as dist

    from megatron_rl.actor.actor import MegatronActor
    from megatron_rl.actor.launch import initialize_parallel_from
    from megatron_rl.actor.spec import ActorSpec
    from megatron_rl.actor.weights import global_parameters
    from megatron_rl.algo import AlgorithmConfig
    from megatron_rl.config.model import ModelOptions
    from megatron_rl.config.parallel import ParallelConfig
    from megatron_rl.config.rollout import RolloutConfig
    from megatron_rl.config.trainer import ActorConfig, TrainerConfig

    world = dist.get_world_size()
    hf_dir = spec["variants"]["qwen3_moe"]["hf_dir"]

    def build(tp=1, pp=1, ep=1, etp=None, *, aux=AUX_COEFF, pack="auto", **actor_options) -> MegatronActor:
        parallel = ParallelConfig(num_actor_ranks=world, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                  expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                                  sequence_parallel=tp > 1)  # fmt: skip
        s = ActorSpec(
            architecture=hf_dir,
            parallel=parallel,
            model=ModelOptions(transformer_config_overrides={"moe_aux_loss_coeff": aux}),
            trainer=TrainerConfig(lr=1e-3, adam_eps=1e-4, max_tokens_per_microbatch=64, pack_sequences=pack),
            rollout=RolloutConfig(temperature=0.7),
            actor=ActorConfig(**({"use_distributed_optimizer": False} | actor_options)),
            algorithm=AlgorithmConfig(kl_coef=0.05),
        )
        return MegatronActor(s, groups=initialize_parallel_from(parallel, seed=s.trainer.seed))

    def rl_batch(actor, batch, noise):
        lp = actor.compute_logprobs(batch)
        return replace(batch, old_logp=lp.logp + noise[0], ref_logp=lp.logp + noise[1])

    def train(tp=1, pp=1, ep=1, etp=None, *, aux=AUX_COEFF, uneven=False, capture=False, **options) -> dict:
        """Load the HF weights, compute log-probs, take one step: what the test compares."""
        actor = build(tp, pp, ep, etp, aux=aux, **options)
        actor.load_hf_weights(hf_dir)
        batch, noise = make_batch(actor.vocab_size, uneven=uneven)
        lp = actor.compute_logprobs(batch)
        losses: list = []
        if capture:  # each training forward's load-balancing loss in float64, from its router's input
            for router in actor.router_losses.routers:
                router.register_forward_pre_hook(
                    lambda m, args: losses.append(reference_loss(m, args[0])) if m.training else None
                )
        local_mbs = actor._microbatches(batch.select(actor._local_rows(batch.num_sequences)))
        metrics = actor.train_step(replace(batch, old_logp=lp.logp + noise[0], ref_logp=lp.logp + noise[1]))
        out = {
            "logp": lp.logp,
            "metrics": metrics,
            "weights": dict(actor.iter_hf_weights(bucket_bytes=1 << 20)),
            "microbatches": [len(mb.rows) for mb in local_mbs],  # this rank's; 0: a filler
        }
        if ep > 1 or pp > 1:  # what a weight sync sends: full tensors on global rank 0 only
            out["first_rank_weights"] = dict(actor.weight_source(dtype=torch.float32))
        if ep > 1:
            out["engine"] = engine_check(actor, out["first_rank_weights"], batch)
        if tp == 1 and pp == 1:  # every rank's full gradients, by global name (experts: where they live)
            grads = {n: p.main_grad.detach().double().clone() for n, p in global_parameters(actor.model, actor.adapter).items()}
            everyone: list = [None] * world
            dist.all_gather_object(everyone, grads)
            out["grads"] = {n: g for part in everyone for n, g in part.items()}
        if capture:
            out["reference_aux"] = reference_aux(losses, int(batch.loss_mask[:, 1:].sum()), aux)
        return out

    def engine_check(actor, weights: dict, batch) -> dict:
        """The built-in engine takes the sync (per-expert names into transformers' fused
        experts), samples 8 tokens after 4 prompts, and the actor (EP = 2) scores them:
        max |engine log-prob - actor log-prob| at the sampling temperature."""
        from megatron_rl.actor.batch import ActorBatch
        from megatron_rl.rollout.engines.hf import HFEngine
        from megatron_rl.rollout.generation import SamplingParams

        rows = None
        if dist.get_rank() == 0:
            engine = HFEngine(hf_dir, dtype="float32", attn_implementation="eager")
            engine.update_weights(list(weights.items()), version=1)
            prompts = [batch.input_ids[i, :PROMPT].tolist() for i in range(4)]
            completions = engine.generate(prompts, SamplingParams(temperature=0.7, max_new_tokens=8, seed=3))
            rows = [(p + c.token_ids, c.logprobs) for p, (c,) in zip(prompts, completions, strict=True)]
        box = [rows]
        dist.broadcast_object_list(box, src=0)
        rows = box[0]
        width = max(len(ids) for ids, _ in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, (seq, _) in enumerate(rows):
            ids[i, : len(seq)], attn[i, : len(seq)] = torch.tensor(seq), 1
        loss_mask = attn.clone()
        loss_mask[:, :PROMPT] = 0
        scored = actor.compute_logprobs(
            ActorBatch(input_ids=ids, attention_mask=attn, loss_mask=loss_mask, advantages=torch.zeros(ids.shape))
        ).logp
        diffs = [abs(float(scored[i, PROMPT + t]) - lp) for i, (_, lps) in enumerate(rows) for t, lp in enumerate(lps)]
        return {"tokens": len(diffs), "max_abs_dlogp": max(diffs)}

    def reference_loss(router, x: torch.Tensor) -> tuple[float, int]:
        """``(E * sum_i f_i P_i, tokens)`` of one router call (the weights at forward time):
        f_i the share of the k routed slots that went to expert i, P_i its mean probability."""
        x = x.detach().double().reshape(-1, x.shape[-1])
        scores = torch.softmax(x @ router.weight.detach().double().t(), dim=-1)
        k, experts = router.topk, scores.shape[-1]
        chosen = torch.zeros_like(scores).scatter(1, scores.topk(k, dim=1).indices, 1.0)
        f = chosen.sum(0) / (x.shape[0] * k)
        return float(experts * (f * scores.mean(0)).sum()), x.shape[0]

    def reference_aux(losses: list, count: int, coeff: float) -> tuple[float, float]:
        """``(mean load-balancing loss per layer and micro-batch, coeff * sum loss * tokens / count)``
        summed over the ranks (data-parallel here)."""
        sums = torch.tensor([sum(v for v, _ in losses), sum(v * t for v, t in losses), float(len(losses))],
                            dtype=torch.float64)  # fmt: skip
        dist.all_reduce(sums)
        return float(sums[0] / sums[2]), coeff * float(sums[1]) / count

    def diff(a: dict, b: dict) -> float:
        assert a.keys() == b.keys()
        return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)

    def compare(a: dict, b: dict) -> dict:
        keys = ("loss/total", "loss/moe_aux", "moe/load_balancing_loss", "actor/grad_norm")
        out = {
            "logp": float((a["logp"] - b["logp"]).abs().max()),
            "metrics": {k: [a["metrics"].get(k), b["metrics"].get(k)] for k in keys},
            "weights": diff(a["weights"], b["weights"]),
        }
        if "grads" in a and "grads" in b:
            out["grads"] = diff(a["grads"], b["grads"])
            out["grad_scale"] = max(float(g.abs().max()) for g in b["grads"].values())
        return out

    report: dict = {}
    ep1 = train(capture=True)
    report["reference_aux"] = ep1["reference_aux"]
    report["ep1_metrics"] = {k: v for k, v in ep1["metrics"].items() if k.startswith(("loss/", "moe/"))}
    ep2 = train(ep=2)
    report["ep2_vs_ep1"] = compare(ep2, ep1)
    report["engine"] = ep2["engine"]
    sent = ep2["first_rank_weights"]
    report["first_rank_sync"] = {"names": sorted(sent), "diff": diff(sent, ep1["weights"]) if sent else None}
    # Without the load-balancing term the data-parallel split does not matter either
    # (global token normalisation): TP and PP (one replica) equal EP (two replicas).
    plain = train(aux=0.0)
    pp2 = train(pp=2, aux=0.0)
    sent = pp2["first_rank_weights"]
    report["pp2_sync"] = {"names": sorted(sent), "diff": diff(sent, plain["weights"]) if sent else None}
    report["no_aux"] = {
        "ep2": compare(train(ep=2, aux=0.0), plain),
        "tp2_sp": compare(train(tp=2, aux=0.0), plain),
        "pp2": compare(pp2, plain),
        "aux_metrics": {k: v for k, v in plain["metrics"].items() if k.startswith(("loss/moe", "moe/"))},
    }
    # TP = 2 with each expert whole on one rank (expert TP 1) over EP = 2: the same step; a
    # weight sync gathers the experts over their own groups; a checkpoint saved there
    # resumes there like not stopping, and at TP = 1 (the expert layout unchanged).
    whole = train(tp=2, ep=2, etp=1, aux=0.0)
    report["no_aux"]["tp2_etp1_ep2"] = compare(whole, plain)
    sent = whole["first_rank_weights"]
    report["etp1"] = {"first_rank_sync": {"names": sorted(sent), "diff": diff(sent, plain["weights"]) if sent else None},
                      "engine": whole["engine"]}  # fmt: skip
    uneven_ep1 = train(uneven=True)
    uneven_ep2 = train(ep=2, uneven=True)
    # Checkpoints saved at EP = 2 after one step, in both optimizer formats: resumed at
    # EP = 2 the second step equals the one taken without stopping; at EP = 1 (one
    # optimizer instead of megatron's dense + expert pair) the weights load, Adam restarts.
    work = Path(spec["work_dir"])
    batch, noise = make_batch(250)
    resumes = {}
    for sharding in ("fully_reshardable", "dp_reshardable"):
        options = dict(use_distributed_optimizer=True, checkpoint_optimizer_sharding=sharding)
        actor = build(ep=2, **options)
        actor.load_hf_weights(hf_dir)
        actor.train_step(rl_batch(actor, batch, noise))
        actor.save_checkpoint(work / sharding / "step_1")
        second = actor.train_step(rl_batch(actor, batch, noise))
        straight = dict(actor.iter_hf_weights(bucket_bytes=1 << 20))
        for ep in (1, 2):
            resumed = build(ep=ep, **options)
            record = resumed.load_checkpoint(work / sharding)
            metrics = resumed.train_step(rl_batch(resumed, batch, noise))
            resumes[f"{sharding}_ep{ep}"] = {
                "loaded_optimizer": record["loaded_optimizer"],
                "loss": [metrics["loss/total"], second["loss/total"]],
                "weights": diff(dict(resumed.iter_hf_weights(bucket_bytes=1 << 20)), straight),
            }
    # (No load-balancing term: with it, the TP = 1 layout's data-parallel ranks would balance
    # other token sets than the sequence-parallel ranks of TP = 2.)
    options = dict(aux=0.0, use_distributed_optimizer=True, checkpoint_optimizer_sharding="fully_reshardable")
    actor = build(tp=2, ep=2, etp=1, **options)
    actor.load_hf_weights(hf_dir)
    actor.train_step(rl_batch(actor, batch, noise))
    actor.save_checkpoint(work / "etp1" / "step_1")
    second = actor.train_step(rl_batch(actor, batch, noise))
    straight = dict(actor.iter_hf_weights(bucket_bytes=1 << 20))
    for name, layout in (("etp1_same", dict(tp=2, ep=2, etp=1)), ("etp1_at_tp1", dict(tp=1, ep=2))):
        resumed = build(**layout, **options)
        record = resumed.load_checkpoint(work / "etp1")
        metrics = resumed.train_step(rl_batch(resumed, batch, noise))
        resumes[name] = {
            "loaded_optimizer": record["loaded_optimizer"],
            "loss": [metrics["loss/total"], second["loss/total"]],
            "weights": diff(dict(resumed.iter_hf_weights(bucket_bytes=1 << 20)), straight),
        }
    report["resume"] = resumes
    per_rank: list = [None] * world
    dist.all_gather_object(per_rank, uneven_ep2["microbatches"])
    report["uneven"] = {"ep2_vs_ep1": compare(uneven_ep2, uneven_ep1), "microbatches": per_rank}
    # A full activation recompute re-runs the routers in the backward pass: the same
    # losses, router metrics and update (fillers included: they add no loss there either).
    report["full_recompute"] = compare(train(ep=2, uneven=True, recompute_granularity="full"), uneven_ep2)
    report["replay"] = run_cases(partial(build, pack=False), hf_dir, make_batch(250)[0])
    return report


if __name__ == "__main__":
    import json
    import sys

    import torch

    from megatron_rl.actor.launch import init_process_group

    init_process_group()
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    result = run(spec)

    def plain(value):
        if isinstance(value, torch.Tensor):
            return value.tolist()
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value

    (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(plain(result)))
    from megatron_rl.actor.launch import destroy_process_groups

    destroy_process_groups()
