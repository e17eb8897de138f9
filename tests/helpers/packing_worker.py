"""torchrun worker for tests/distributed/test_packing.py: packed vs padded micro-batches.

Usage::

    torchrun --standalone --nproc_per_node 2 tests/helpers/packing_worker.py SPEC.json OUT_DIR

At each layout (TP, PP) of the 2 ranks, (1,1) x DP2, (2,1), (1,2), two actors are built
from the same HF weights, one with ``trainer.pack_sequences`` and one without, and fed
the same batch of mixed lengths (a small token budget, so several micro-batches). Each
rank writes ``OUT_DIR/rank<r>.json`` with, per layout: the largest difference between
the two actors' log-probs / entropies, the packed log-probs against a float64
transformers forward, how much the other sequences' log-probs move when one sequence's
tokens change (packed), and for a series of optimizer steps with the token-weighted
losses the two losses, grad norms and the largest difference of any gradient element
(megatron's ``main_grad``, max over ranks), plus each actor's padding fraction.
"""

from __future__ import annotations

N, L, PROMPT = 8, 24, 4
TEMPERATURE = 0.8
LAYOUTS = [(1, 1), (2, 1), (1, 2)]
MAX_TOKENS = 48  # a few sequences per micro-batch: several micro-batches either way


def algorithms() -> dict:
    """One optimizer step each, in this order, on both actors."""
    from megatron_rl.algo import AlgorithmConfig, ARConfig, LoptiConfig, STAPOConfig, TRGRPOConfig

    return {
        "grpo_kl_entropy": (AlgorithmConfig(kl_coef=0.05, entropy_coef=0.01), None),
        "seq_mean_token_mean": (AlgorithmConfig(aggregation="seq_mean_token_mean"), None),
        "dr_grpo_seq_mean_token_sum_norm": (
            AlgorithmConfig(aggregation="seq_mean_token_sum_norm", constant_normalizer=L),
            None,
        ),
        "ar": (AlgorithmConfig(ar=ARConfig(alpha=0.3)), None),
        "lopti_low": (AlgorithmConfig(lopti=LoptiConfig(enabled=True, eta=0.004)), "low"),
        "lopti_high": (AlgorithmConfig(lopti=LoptiConfig(enabled=True, eta=0.004)), "high"),
        "tr_grpo": (AlgorithmConfig(tr_grpo=TRGRPOConfig(enabled=True)), None),
        "stapo": (AlgorithmConfig(stapo=STAPOConfig(enabled=True, tau_p=0.004, entropy_quantile=0.75)), None),
    }


def make_batch(vocab: int):
    import torch

    from megatron_rl.actor.batch import ActorBatch

    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, vocab, (N, L), generator=g)
    # Mixed lengths, short and long (K&K-like), one full-length row.
    lengths = torch.tensor([L, 6, 17, 9, 23, 7, 12, 20])
    attn = (torch.arange(L)[None] < lengths[:, None]).long()
    loss_mask = attn.clone()
    loss_mask[:, :PROMPT] = 0
    advantages = torch.randn(N, 1, generator=g).expand(N, L).clone()
    return ActorBatch(input_ids=ids, attention_mask=attn, loss_mask=loss_mask, advantages=advantages)


def hf_logp(hf_dir: str, batch):
    """float64 transformers log-probs of each sequence on its own, input-aligned."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float64, attn_implementation="eager")
    out = torch.zeros(N, L, dtype=torch.float64)
    with torch.no_grad():
        for i, n in enumerate(batch.lengths.tolist()):
            ids = batch.input_ids[i : i + 1, :n]
            logprobs = torch.log_softmax(model(ids).logits[0] / TEMPERATURE, dim=-1)
            out[i, 1:n] = logprobs[:-1].gather(-1, ids[0, 1:, None]).squeeze(-1)
    return out


def run(spec: dict) -> dict:
    import torch
    import torch.distributed as dist

    from megatron_rl.actor.actor import MegatronActor
    from megatron_rl.actor.batch import ActorBatch
    from megatron_rl.actor.launch import initialize_parallel
    from megatron_rl.actor.spec import ActorSpec
    from megatron_rl.config.parallel import ParallelConfig
    from megatron_rl.config.rollout import RolloutConfig
    from megatron_rl.config.trainer import ActorConfig, TrainerConfig
    from tests.helpers.tiny_hf import VOCAB

    hf_dir = spec["variants"]["qwen2_gqa"]["hf_dir"]
    base = make_batch(VOCAB)
    real = base.attention_mask.bool().clone()
    real[:, 0] = False
    reference = hf_logp(hf_dir, base)
    report: dict = {}

    def build(tp: int, pp: int, pack: bool) -> MegatronActor:
        actor_spec = ActorSpec(
            architecture=hf_dir,
            parallel=ParallelConfig(
                num_actor_ranks=dist.get_world_size(), tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
            ),
            trainer=TrainerConfig(lr=1e-3, adam_eps=1e-4, max_tokens_per_microbatch=MAX_TOKENS, pack_sequences=pack),
            actor=ActorConfig(use_distributed_optimizer=False),  # full gradients on every DP rank
            rollout=RolloutConfig(temperature=TEMPERATURE),
        )
        groups = initialize_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, seed=1)
        actor = MegatronActor(actor_spec, groups=groups)
        actor.load_hf_weights(hf_dir)
        return actor

    def max_grad_diff(a: MegatronActor, b: MegatronActor) -> float:
        pa, pb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
        worst = max(float((pa[k].main_grad - pb[k].main_grad).abs().max()) for k in pa)
        t = torch.tensor([worst], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    def grad_scale(a: MegatronActor) -> float:
        t = torch.tensor([max(float(p.main_grad.abs().max()) for p in a.model.parameters())], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    for tp, pp in LAYOUTS:
        key = f"tp{tp}_pp{pp}"
        packed, padded = build(tp, pp, True), build(tp, pp, False)
        entry: dict = {"dp": packed.groups.dp_size}
        lp_packed = packed.compute_logprobs(base)
        lp_padded = padded.compute_logprobs(base)
        entry["logp_packed_vs_padded"] = float((lp_packed.logp - lp_padded.logp).abs().max())
        entry["entropy_packed_vs_padded"] = float((lp_packed.entropy - lp_padded.entropy).abs().max())
        entry["logp_packed_vs_hf"] = float((lp_packed.logp.double() - reference)[real].abs().max())
        entry["logp_packed_padding_zero"] = bool((lp_packed.logp[~real] == 0).all())

        # Change the response tokens of row 3 (its length stays): nothing else may move.
        ids = base.input_ids.clone()
        ids[3, PROMPT:] = (ids[3, PROMPT:] + 1) % VOCAB
        moved = packed.compute_logprobs(ActorBatch(input_ids=ids, attention_mask=base.attention_mask)).logp
        others = [i for i in range(N) if i != 3]
        entry["perturbed_row_change"] = float((moved[3] - lp_packed.logp[3]).abs().max())
        entry["other_rows_change"] = float((moved[others] - lp_packed.logp[others]).abs().max())

        noise = torch.Generator().manual_seed(5)
        steps = {}
        for name, (algorithm, phase) in algorithms().items():
            # old/ref log-probs near the current ones, so ratios, clipping and KL are non-trivial.
            current = padded.compute_logprobs(base).logp
            batch = ActorBatch(
                input_ids=base.input_ids,
                attention_mask=base.attention_mask,
                loss_mask=base.loss_mask,
                advantages=base.advantages,
                old_logp=current + 0.1 * torch.randn(N, L, generator=noise),
                ref_logp=current + 0.2 * torch.randn(N, L, generator=noise),
            )
            mp = packed.train_step(batch, algorithm=algorithm, phase=phase)
            md = padded.train_step(batch, algorithm=algorithm, phase=phase)
            steps[name] = {
                "loss": [mp["loss/total"], md["loss/total"]],
                "grad_norm": [mp["actor/grad_norm"], md["actor/grad_norm"]],
                "max_grad_diff": max_grad_diff(packed, padded),
                "grad_scale": grad_scale(padded),
                "padding_fraction": [mp["actor/padding_fraction"], md["actor/padding_fraction"]],
                "packed_fraction": [mp["actor/packed_fraction"], md["actor/packed_fraction"]],
                "num_microbatches": [mp["actor/num_microbatches"], md["actor/num_microbatches"]],
            }
        entry["steps"] = steps
        after_p, after_d = packed.compute_logprobs(base).logp, padded.compute_logprobs(base).logp
        entry["logp_after_steps_packed_vs_padded"] = float((after_p - after_d).abs().max())
        entry["logp_moved_by_steps"] = float((after_d - lp_padded.logp).abs().max())
        report[key] = entry
        del packed, padded
    return report


if __name__ == "__main__":
    from tests.helpers.worker_main import run_worker

    run_worker(lambda spec, out_dir: run(spec))
