"""Chunking of the fused op: the per-device chunk budgets, results independent of the
chunk size, and no host synchronisation inside the chunk loops.

A host synchronisation per chunk (``bool(t.any())``, ``.item()``, a boolean-mask
assignment, ...) costs nothing on CPU but stalls a GPU once per chunk. On CPU it is
caught by counting, under a ``TorchFunctionMode``, the tensor operations that read a
device value back to the host (or would on CUDA): their number must not grow with the
number of chunks. On CUDA, ``torch.cuda.set_sync_debug_mode`` counts the real ones.
"""

import warnings
from dataclasses import replace

import pytest
import torch
from torch.overrides import TorchFunctionMode

from megatron_rl.algo import AlgorithmConfig
from megatron_rl.ops import (
    LossInputs,
    VocabParallelOptions,
    fused_linear_policy_loss,
    fused_policy_loss,
    vocab_parallel_logprobs,
)
from megatron_rl.ops import vocab_parallel as vp
from tests.fused_reference import make_inputs, make_linear_inputs, naive_loss
from tests.loss_cases import LOSS_CASES, lopti_phase_for

MiB = 2**20
CFG = AlgorithmConfig(kl_coef=0.01, entropy_coef=0.01)  # PPO-clip + KL + entropy: every gradient term

# Tensor methods and functions that read device memory on the host (a device sync on CUDA).
_SYNC_NAMES = {
    "__bool__", "__int__", "__float__", "__index__", "__complex__", "item", "tolist", "numpy", "cpu",
    "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount", "repeat_interleave",
}  # fmt: skip


def _has_bool_index(args) -> bool:
    index = args[1] if len(args) > 1 else None
    parts = index if isinstance(index, tuple | list) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


class CountHostSyncs(TorchFunctionMode):
    """Counts the calls that synchronise with the device (boolean-mask indexing included:
    on CUDA it runs ``nonzero``)."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _SYNC_NAMES or (
            name in ("__getitem__", "__setitem__", "index_put_", "index_put") and _has_bool_index(args)
        ):
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


def _inputs(seed=0, dtype=torch.float32):
    logits, targets, mask, old, ref, adv = make_inputs(seed=seed, dtype=dtype)
    assert not mask.all()  # masked-out tokens: the gradient loop has rows to zero
    return logits, LossInputs(targets=targets, old_logp=old, advantages=adv, mask=mask, ref_logp=ref)


def _fused(dtype=torch.float32):
    logits, inputs = _inputs(dtype=dtype)

    def run(opts):
        out, _ = fused_policy_loss(logits.clone().requires_grad_(), inputs, CFG, opts)
        out.loss_sum.backward()

    return run


def _fused_bf16():
    return _fused(torch.bfloat16)


def _fused_linear():
    _, inputs = _inputs()
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 7, 16, generator=g)
    weight = 0.5 * torch.randn(37, 16, generator=g)

    def run(opts):
        out, _ = fused_linear_policy_loss(
            hidden.clone().requires_grad_(), weight.clone().requires_grad_(), inputs, CFG, opts
        )
        out.loss_sum.backward()

    return run


def _logprobs():
    logits, inputs = _inputs()
    return lambda opts: vocab_parallel_logprobs(logits, inputs.targets, mask=inputs.mask, options=opts)


@pytest.mark.parametrize("make", [_fused, _fused_bf16, _fused_linear, _logprobs], ids=lambda f: f.__name__)
def test_no_host_sync_per_chunk(make):
    """21 tokens in 21 chunks read back from the device exactly as often as in 1 chunk."""
    run = make()

    def syncs(chunk_tokens) -> list[str]:
        opts = VocabParallelOptions(chunk_tokens=chunk_tokens, temperature=0.8, token_grad_norms=True)
        with CountHostSyncs() as mode:
            run(opts)
        return mode.calls

    one_chunk = syncs(21)
    # Twice per call: the target-id check and which rows are masked; the loss and its
    # metrics read nothing back (no boolean-mask indexing); none per chunk. The fused
    # lm-head's training call reads once more: which rows have a loss (it multiplies
    # only those).
    assert len(one_chunk) <= (3 if make is _fused_linear else 2), one_chunk
    assert syncs(1) == one_chunk
    assert syncs(4) == one_chunk


def test_the_counter_sees_the_syncs_it_is_for():
    x = torch.randn(4)
    with CountHostSyncs() as mode:
        bool((x > 0).any())
        x.sum().item()
        x[x > 0] = 0
        x.masked_fill_(x > 0, 0)  # no sync
    assert mode.calls == ["__bool__", "item", "__setitem__"]


def test_chunk_budget_by_device():
    assert vp.chunk_budget_bytes("cpu") == vp.DEFAULT_CHUNK_BYTES == 4 * MiB
    assert vp.chunk_budget_bytes("cuda") == vp.chunk_budget_bytes(torch.device("cuda", 1)) == 256 * MiB
    assert vp.chunk_budget_bytes("cpu", linear=True) == vp.LINEAR_CHUNK_BYTES["cpu"] == 64 * MiB
    assert vp.chunk_budget_bytes("cuda", linear=True) == vp.LINEAR_CHUNK_BYTES["cuda"] == 1024 * MiB
    assert vp.chunk_budget_bytes("meta") == vp.CHUNK_BYTES["cpu"]  # anything but CUDA: the CPU budget
    v_local = 151_936 // 4  # Qwen2.5's vocabulary at TP = 4
    assert vp.chunk_rows(10**6, v_local, None, "cpu") == 27
    assert vp.chunk_rows(10**6, v_local, None, "cuda") == 1766
    assert vp.chunk_rows(10**6, v_local, None) == 27  # the default device is the CPU
    assert vp.chunk_rows(100, v_local, None, "cuda") == 100  # never more rows than tokens
    assert vp.chunk_rows(10**6, v_local, 8, "cuda") == 8  # an explicit chunk size wins
    assert vp.linear_chunk_rows(10**6, v_local, "cuda") == 7067  # 1 GiB: the matmuls and the main_grad accumulation want large chunks
    assert vp.linear_chunk_rows(10**6, v_local, "cpu") == 441


def test_invalid_rows_per_chunk():
    valid = torch.tensor([1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 0], dtype=torch.bool)

    def rows(chunk):
        return [None if t is None else t.tolist() for t in vp.invalid_rows_per_chunk(valid, chunk)]

    assert rows(3) == [None, [0], None, [1]]
    assert rows(4) == [[3], None, [2]]
    assert rows(11) == [[3, 10]]
    assert rows(20) == [[3, 10]]
    assert vp.invalid_rows_per_chunk(valid[:3], 2) == [None, None]
    assert vp.invalid_rows_per_chunk(valid[:0], 2) == []
    assert vp.chunk_slices(11, 4) == [slice(0, 4), slice(4, 8), slice(8, 11)]


@pytest.mark.parametrize("budget", [1, 3 * 37 * 4, 1 << 30], ids=["1_token", "3_tokens", "all_tokens"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_budget_does_not_change_results(monkeypatch, budget, dtype):
    """The default chunking (the budget) gives the float64 reference's loss, log-probs,
    entropies and gradients to float rounding, from 1-token chunks to one chunk."""
    monkeypatch.setitem(vp.CHUNK_BYTES, "cpu", budget)
    cfg = LOSS_CASES["all_composed"]
    logits, targets, mask, old, ref, adv = make_inputs(seed=21, dtype=dtype)
    want, want_grad, want_lp, want_h, _ = naive_loss(
        logits, targets, mask, old, ref, adv, cfg, temperature=0.7, phase="low"
    )
    x = logits.clone().requires_grad_()
    inputs = LossInputs(targets=targets, old_logp=old, advantages=adv, mask=mask, ref_logp=ref, phase="low")
    out, stats = fused_policy_loss(x, inputs, cfg, VocabParallelOptions(temperature=0.7))
    (out.loss_sum / out.count.to(out.loss_sum.dtype)).backward()
    assert float(out.loss_sum.detach() / out.count) == pytest.approx(float(want), abs=1e-5, rel=1e-5)
    valid = mask.reshape(-1)
    torch.testing.assert_close(stats.logp[valid].double(), want_lp.reshape(-1)[valid], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stats.entropy[valid].double(), want_h.reshape(-1)[valid], atol=1e-5, rtol=1e-5)
    rtol = 1e-5 if dtype == torch.float32 else 1.6e-2  # the gradient comes back in bf16
    torch.testing.assert_close(x.grad.double(), want_grad, atol=1e-5, rtol=rtol)
    assert x.grad[~mask].abs().max() == 0


@pytest.mark.parametrize("budget", [1, 1 << 30], ids=["1_token", "all_tokens"])
def test_linear_budget_does_not_change_results(monkeypatch, budget):
    monkeypatch.setitem(vp.LINEAR_CHUNK_BYTES, "cpu", budget)
    cfg = LOSS_CASES["grpo_kl_k3_entropy"]
    hidden, weight, inputs, (targets, mask, old, ref, adv) = make_linear_inputs(22, 3)
    want, want_grad, *_ = naive_loss(hidden @ weight.t(), targets, mask, old, ref, adv, cfg, temperature=1.0)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out, _ = fused_linear_policy_loss(h, w, inputs, cfg)
    (out.loss_sum / out.count).backward()
    assert float(out.loss_sum.detach() / out.count) == pytest.approx(float(want), abs=1e-12)
    torch.testing.assert_close(h.grad, want_grad @ weight, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(w.grad, want_grad.reshape(-1, 37).t() @ hidden.reshape(-1, 16), atol=1e-12, rtol=1e-10)


def test_a_given_workspace_sets_the_chunk_size():
    logits, inputs = _inputs()
    flat = logits.reshape(-1, 37)
    valid = inputs.mask.reshape(-1)
    ws = vp.ChunkWorkspace(5, 37, torch.float32, flat.device)
    seen = []

    def chunk(sl):
        seen.append(sl)
        return flat[sl]

    kw = dict(vocab_local=37, temperature=1.0, tp_group=None, vocab_size=None, chunk_tokens=None)
    got = vp.softmax_stats(chunk, inputs.targets.reshape(-1), valid, workspace=ws, **kw)
    assert [s.stop - s.start for s in seen] == [5, 5, 5, 5, 1]
    want = vp.softmax_stats(lambda sl: flat[sl], inputs.targets.reshape(-1), valid, **kw)
    torch.testing.assert_close(got.logp, want.logp)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_no_device_sync_per_chunk_on_cuda(kernel):
    """On CUDA: the synchronising calls (torch's sync debug mode) do not grow with the chunks."""
    logits, inputs = _inputs()
    dev = torch.device("cuda")
    inputs = LossInputs(**{k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in vars(inputs).items()})

    def syncs(chunk_tokens):
        x = logits.to(dev).requires_grad_()
        options = VocabParallelOptions(chunk_tokens=chunk_tokens, kernel=kernel)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                out, _ = fused_policy_loss(x, inputs, CFG, options)
                out.loss_sum.backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return [f"{w.filename}:{w.lineno}" for w in caught if "synchronizing" in str(w.message)]

    syncs(21)  # a first call may synchronise once more (lazy initialisation, kernel compilation)
    few, many = syncs(21), syncs(1)
    assert len(few) == len(many), (few, many)


class _CountLogitMatmuls(TorchFunctionMode):
    """Counts the matmuls that produce logits (an output ``vocab`` columns wide)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.count = vocab, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if getattr(func, "__name__", "") in ("matmul", "__matmul__") and out.shape[-1] == self.vocab:
            self.count += 1
        return out


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_linear_one_chunk_multiplies_once_and_the_stats_pass_leaves_its_logits_alone(temperature, dtype):
    """With every token in one chunk the gradient pass takes the statistics pass's logits
    instead of multiplying again: one ``h @ W^T`` per forward, and those logits are
    bitwise ``h @ W^T`` still when the gradient pass gets them (the statistics pass
    reads them in place when no conversion or scaling is needed: float32 at T=1)."""
    from megatron_rl.ops.fused_policy_loss import _ChunkLogits, _stats

    hidden, weight, inputs, _ = make_linear_inputs(23, 4)
    h, w = hidden.reshape(-1, 16).to(dtype), weight.to(dtype)
    chunk = _ChunkLogits(h, w)
    options = VocabParallelOptions(temperature=temperature)
    _stats(chunk.keeping_whole, inputs.targets, inputs.mask, 37, options, dtype, None, "torch")
    whole = slice(0, h.shape[0])
    kept = chunk(whole)
    assert torch.equal(kept, h @ w.t())
    assert chunk(whole) is not kept  # handed over once; a later call multiplies again

    cfg = LOSS_CASES["grpo_kl_k3_entropy"]
    hr, wr = hidden.to(dtype).requires_grad_(), w.clone().requires_grad_()
    with _CountLogitMatmuls(37) as counter:
        out, _ = fused_linear_policy_loss(hr, wr, inputs, cfg, VocabParallelOptions(temperature=temperature))
    assert counter.count == 1
    (out.loss_sum / out.count).backward()
    _, want_grad, *_ = naive_loss(hidden @ weight.t(), *_linear_tensors(inputs), cfg, temperature=temperature)
    tol = dict(atol=1e-12, rtol=1e-10) if dtype == torch.float64 else dict(atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(hr.grad.double(), want_grad @ weight, **tol)


def _linear_tensors(inputs):
    return inputs.targets, inputs.mask, inputs.old_logp, inputs.ref_logp, inputs.advantages


class _LogitMatmulRows(TorchFunctionMode):
    """The rows of every matmul that produces logits (an output ``vocab`` columns wide)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.rows = vocab, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if getattr(func, "__name__", "") in ("matmul", "__matmul__") and out.shape[-1] == self.vocab:
            self.rows.append(out.shape[0])
        return out


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("case", list(LOSS_CASES))
def test_linear_training_multiplies_only_the_loss_tokens_with_the_same_results(case, device):
    """A training call takes only the masked-in tokens through the lm-head (prompt and
    padding rows have no loss): one logits matmul of ``mask.sum()`` rows, and the loss,
    both gradients and the statistics of every loss token equal the float64 reference of
    all tokens (statistics 0 elsewhere), for every loss and aggregation, on the host and
    on CUDA."""
    cfg = LOSS_CASES[case]
    phase = lopti_phase_for(case, cfg)
    hidden, weight, inputs, tensors = make_linear_inputs(5, 6)
    mask = inputs.mask.bool()
    assert 0 < int(mask.sum()) < mask.numel()  # some tokens are padding
    inputs = replace(inputs, phase=phase)
    on = {k: v.to(device) for k, v in vars(inputs).items() if isinstance(v, torch.Tensor)}
    hr, wr = hidden.to(device).requires_grad_(), weight.to(device).requires_grad_()
    with _LogitMatmulRows(37) as counter:
        out, stats = fused_linear_policy_loss(hr, wr, replace(inputs, **on), cfg, VocabParallelOptions(temperature=0.9))
    assert counter.rows == [int(mask.sum())]
    mean = out.loss_sum / out.count
    mean.backward()
    mean, grad_h, grad_w = mean.detach().cpu(), hr.grad.cpu(), wr.grad.cpu()
    stat_logp, stat_entropy, stat_lse = stats.logp.cpu(), stats.entropy.cpu(), stats.log_normalizer.cpu()
    loss, grad, logp, entropy, _ = naive_loss(hidden @ weight.t(), *tensors, cfg, temperature=0.9,
                                              phase=phase)  # fmt: skip
    tol = dict(atol=1e-10, rtol=1e-8)
    if loss.isnan():  # lopti_high_phase_den: no token in the high phase here (0 / 0; a skipped step)
        assert mean.isnan()
    else:
        torch.testing.assert_close(mean.double(), loss, **tol)
        torch.testing.assert_close(grad_h, grad @ weight, **tol)
        torch.testing.assert_close(grad_w, grad.reshape(-1, 37).t() @ hidden.reshape(-1, 16), **tol)
    flat = mask.reshape(-1)
    torch.testing.assert_close(stat_logp[flat], logp.reshape(-1)[flat], **tol)
    torch.testing.assert_close(stat_entropy[flat], entropy.reshape(-1)[flat], **tol)
    assert not stat_logp[~flat].any() and not stat_lse[~flat].any()
