"""Global token normalisation makes gradients independent of the batch layout.

1, 2 and 4 gloo ranks (data-parallel) x 1, 2 and 4 micro-batches: each micro-batch
back-propagates its unnormalised ``loss_sum``; gradients and counts are summed over
the ranks and the gradient is divided by the global count once (what megatron-core's
``calculate_per_token_loss`` does). The result must equal the single-batch gradient.
"""

import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_rl.algo import (
    AdvantageConfig,
    AlgorithmConfig,
    ARConfig,
    LoptiConfig,
    STAPOConfig,
    TRGRPOConfig,
    broadcast_to_tokens,
    compute_advantages,
    compute_policy_loss,
    prepare_advantages,
    stapo_candidates,
    stapo_entropy_threshold,
)
from megatron_rl.algo.methods.stapo import STAPO_THRESHOLD_KEY
from tests.dist_utils import file_store_url, start_ranks

NUM_SEQS, SEQ_LEN, HIDDEN, VOCAB, TEMPERATURE = 16, 8, 6, 11, 0.7

CONFIGS = {
    "token_mean": AlgorithmConfig(),
    "token_mean_kl_entropy_ar": AlgorithmConfig(kl_coef=0.1, entropy_coef=0.05, ar=ARConfig(alpha=0.3)),
    "seq_mean": AlgorithmConfig(aggregation="seq_mean_token_mean", kl_coef=0.1),
    "dr_grpo_norm": AlgorithmConfig(aggregation="seq_mean_token_sum_norm", constant_normalizer=SEQ_LEN),
    "lopti_low": AlgorithmConfig(lopti=LoptiConfig(enabled=True, eta=0.15), kl_coef=0.1),
    "tr_grpo": AlgorithmConfig(tr_grpo=TRGRPOConfig(enabled=True, tau=0.5)),
    "stapo": AlgorithmConfig(stapo=STAPOConfig(enabled=True, tau_p=0.12, entropy_quantile=0.5)),
}
MICROBATCH_MEAN = AlgorithmConfig(aggregation="reference_microbatch_mean")


def make_data():
    """Same tensors on every rank (fixed seed): a linear 'model' over fixed hidden states."""
    g = torch.Generator().manual_seed(1234)
    h = torch.randn(NUM_SEQS, SEQ_LEN, HIDDEN, generator=g, dtype=torch.float64)
    w0 = torch.randn(HIDDEN, VOCAB, generator=g, dtype=torch.float64)
    targets = torch.randint(0, VOCAB, (NUM_SEQS, SEQ_LEN), generator=g)
    lengths = torch.randint(1, SEQ_LEN + 1, (NUM_SEQS,), generator=g)
    mask = (torch.arange(SEQ_LEN)[None] < lengths[:, None]).long()
    targets = torch.where(mask.bool(), targets, torch.full_like(targets, -100))  # padding ids
    rewards = torch.randint(0, 3, (NUM_SEQS,), generator=g).to(torch.float64)
    groups = torch.arange(NUM_SEQS) // 4
    with torch.no_grad():
        old_logp, _ = logp_and_entropy(h, w0 + 0.3 * torch.randn(w0.shape, generator=g, dtype=torch.float64), targets)
        ref_logp, _ = logp_and_entropy(h, w0 + 0.3 * torch.randn(w0.shape, generator=g, dtype=torch.float64), targets)
    adv = broadcast_to_tokens(compute_advantages(rewards, groups, AdvantageConfig()), mask).double()
    return h, w0, targets, mask, old_logp, ref_logp, adv


def logp_and_entropy(h, w, targets):
    logits = (h @ w) / TEMPERATURE
    logprobs = torch.log_softmax(logits, dim=-1)
    safe = targets.clamp(min=0)
    logp = logprobs.gather(-1, safe[..., None]).squeeze(-1)
    entropy = -(logprobs.exp() * logprobs).sum(-1)
    return logp, entropy


def single_batch_grad(cfg):
    h, w0, targets, mask, old, ref, adv = make_data()
    adv, _ = prepare_advantages(adv, old, mask, cfg)
    w = w0.clone().requires_grad_()
    logp, ent = logp_and_entropy(h, w, targets)
    phase = "low" if cfg.lopti.enabled else None
    out = compute_policy_loss(logp, old, adv, mask, cfg, ref_logp=ref, entropy=ent, phase=phase)
    (out.loss_sum / out.count).backward()
    return w.grad, out


def distributed_grad(cfg, num_microbatches, group=None):
    """This rank's share of sequences, split into micro-batches; returns the global gradient."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if group is not None else (0, 1)
    h, w0, targets, mask, old, ref, adv = make_data()
    adv, _ = prepare_advantages(adv, old, mask, cfg)
    per_rank = NUM_SEQS // world
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    chunks = [
        torch.arange(NUM_SEQS)[mine][i::num_microbatches] for i in range(num_microbatches)
    ]  # interleaved: micro-batches need not be contiguous
    phase = "low" if cfg.lopti.enabled else None
    w = w0.clone().requires_grad_()

    threshold = None
    if cfg.stapo.enabled:  # forward-only pre-pass over the mini-batch, all-gathered over DP
        with torch.no_grad():
            lp, ent = logp_and_entropy(h[mine], w, targets[mine])
            cand = stapo_candidates(adv[mine], lp, mask[mine], cfg.stapo.tau_p)
            threshold = stapo_entropy_threshold(ent, cand, cfg.stapo.entropy_quantile, group=group)

    count = torch.zeros((), dtype=torch.float64)
    for idx in chunks:
        logp, ent = logp_and_entropy(h[idx], w, targets[idx])
        out = compute_policy_loss(
            logp, old[idx], adv[idx], mask[idx], cfg, ref_logp=ref[idx], entropy=ent,
            phase=phase, prepass={STAPO_THRESHOLD_KEY: threshold} if threshold is not None else None,
        )
        out.loss_sum.backward()
        count += out.count
    grad = w.grad.clone()
    if group is not None:
        dist.all_reduce(grad, group=group)
        dist.all_reduce(count, group=group)
    return grad / count


def microbatch_mean_reference(num_microbatches, world):
    """The AR/Lopti code's normalisation: token mean per micro-batch, then averaged."""
    h, w0, targets, mask, old, ref, adv = make_data()
    w = w0.clone().requires_grad_()
    total = 0.0
    per_rank = NUM_SEQS // world
    for rank in range(world):
        ids = torch.arange(NUM_SEQS)[rank * per_rank:(rank + 1) * per_rank]
        for i in range(num_microbatches):
            idx = ids[i::num_microbatches]
            logp, _ = logp_and_entropy(h[idx], w, targets[idx])
            out = compute_policy_loss(logp, old[idx], adv[idx], mask[idx], AlgorithmConfig())
            total = total + out.loss_sum / out.count
    (total / (world * num_microbatches)).backward()
    return w.grad


def _worker(rank, world, store_url, results):
    dist.init_process_group("gloo", init_method=store_url, rank=rank, world_size=world)
    try:
        group = dist.group.WORLD
        for name, cfg in CONFIGS.items():
            want, _ = single_batch_grad(cfg)
            for mb in (1, 2, 4):
                got = distributed_grad(cfg, mb, group)
                err = float((got - want).abs().max())
                if rank == 0:
                    results.append((name, mb, err))
        for mb in (1, 2, 4):
            got = distributed_grad(MICROBATCH_MEAN, mb, group)
            err = float((got - microbatch_mean_reference(mb, world)).abs().max())
            if rank == 0:
                results.append(("microbatch_mean", mb, err))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [1, 2, 4])
def test_gradients_invariant_to_dp_ranks_and_microbatches(world):
    with mp.Manager() as manager, tempfile.TemporaryDirectory() as rendezvous:
        results = manager.list()
        start_ranks(_worker, (world, file_store_url(rendezvous), results), world)
        results = list(results)
    assert len(results) == (len(CONFIGS) + 1) * 3
    bad = [r for r in results if not r[2] < 1e-12]
    assert not bad, f"gradients differ from the single-batch gradient: {bad}"


def test_setup_is_not_trivial():
    """Guard for the test above: each config has a non-zero gradient, STAPO and Lopti act,
    and the micro-batch mean really differs from the global token mean here."""
    for name, cfg in CONFIGS.items():
        grad, out = single_batch_grad(cfg)
        assert float(grad.abs().max()) > 1e-3, name
        if name == "stapo":
            assert float(out.metrics["loss/stapo/masked_frac"][0]) > 0
        if name == "lopti_low":
            low = float(out.metrics["loss/lopti/low_frac"][0])
            assert 0 < low < float(out.metrics["loss/lopti/low_frac"][1])
    ref = microbatch_mean_reference(4, 2)
    want, _ = single_batch_grad(CONFIGS["token_mean"])
    assert float((ref - want).abs().max()) > 1e-4
