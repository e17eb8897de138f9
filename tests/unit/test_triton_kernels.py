"""The fused loss's Triton kernels (``megatron_rl.ops.triton_kernels``) against float64
math and the torch kernel: on CPU under Triton's interpreter (``TRITON_INTERPRET=1``, which
tests/conftest.py turns on where no GPU is visible), compiled on a CUDA device otherwise.

The interpreter runs the same kernel source the GPU compiles, so on CPU these check the
kernels' arithmetic (the online softmax's rescaling across blocks, the gradient's terms,
masked rows, TP padding columns, the squared norms); the compiled kernels' speed is the
GPU suite's (``benchmarks/gpu_suite.py``).
"""

import os

import pytest
import torch

from megatron_rl.algo import AlgorithmConfig
from megatron_rl.ops import (
    LossInputs,
    VocabParallelOptions,
    fused_linear_policy_loss,
    fused_policy_loss,
    vocab_parallel_logprobs,
)
from megatron_rl.ops import vocab_parallel as vp
from tests.fused_reference import make_inputs, naive_loss

pytest.importorskip("triton", reason="Triton is not installed (the test extra installs it)")
from megatron_rl.ops import triton_kernels  # noqa: E402  (after the skip: it imports Triton)

# The interpreter evaluates both sides of a select with numpy: -inf * 0 there warns, harmlessly.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

ENTROPY = AlgorithmConfig(kl_coef=0.01, entropy_coef=0.01)  # every gradient term, row_shift included
NO_ENTROPY = AlgorithmConfig(kl_coef=0.01)  # the kernel's HAS_SHIFT=False branch


@pytest.fixture
def dev() -> torch.device:
    """Where the kernels run: the CPU under the interpreter, else the GPU (compiled)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    pytest.skip("Triton was imported before TRITON_INTERPRET=1 was set and there is no GPU")


def _to(dev, *tensors):
    return [t.to(dev) if isinstance(t, torch.Tensor) else t for t in tensors]


def _reference_stats(logits: torch.Tensor, targets: torch.Tensor, inv_t: float) -> torch.Tensor:
    z = logits.double() * inv_t
    m = z.amax(-1)
    e = torch.exp(z - m[:, None])
    return torch.stack([m, e.sum(-1), (e * (z - m[:, None])).sum(-1), z.gather(-1, targets[:, None])[:, 0]], -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("order", ["random", "ascending", "descending"])
@pytest.mark.parametrize("block", [16, 64, None])
def test_row_stats_match_float64(dev, dtype, order, block):
    """``[m, S, B, t]`` per row, whether the row maximum moves every block (ascending:
    each block rescales S and B) or never (descending), with a partial last block."""
    g = torch.Generator().manual_seed(1)
    logits = (3 * torch.randn(9, 300, generator=g)).to(dtype)
    if order != "random":
        logits = logits.sort(dim=-1, descending=order == "descending").values
    targets = torch.randint(0, 300, (9,), generator=g)
    out = torch.empty(9, 4, device=dev)
    triton_kernels.row_stats(*_to(dev, logits, targets), 1 / 0.7, out, block=block)
    want = _reference_stats(logits, targets, 1 / 0.7)
    torch.testing.assert_close(out.double().cpu(), want, rtol=2e-6, atol=2e-5)


def test_row_stats_reads_a_column_slice(dev):
    """A ``[:, :V_valid]`` slice of wider rows (TP padding columns) is read by its stride."""
    g = torch.Generator().manual_seed(2)
    wide = torch.randn(5, 48, generator=g)
    wide[:, 40:] = 1e4  # padding columns: they must not enter the max
    targets = torch.randint(0, 40, (5,), generator=g)
    out = torch.empty(5, 4, device=dev)
    wide_dev, targets_dev = _to(dev, wide, targets)
    triton_kernels.row_stats(wide_dev[:, :40], targets_dev, 1.0, out, block=16)
    want = _reference_stats(wide[:, :40], targets, 1.0)
    torch.testing.assert_close(out.double().cpu(), want, rtol=2e-6, atol=2e-5)


def test_bad_launch_arguments_raise():
    tk = triton_kernels
    with pytest.raises(ValueError, match="power of two"):
        tk.row_stats(torch.zeros(2, 8), torch.zeros(2, dtype=torch.long), 1.0, torch.empty(2, 4), block=24)
    with pytest.raises(ValueError, match="float32"):
        tk.row_stats(torch.zeros(2, 8), torch.zeros(2, dtype=torch.long), 1.0, torch.empty(2, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous rows"):
        tk.row_stats(torch.zeros(8, 2).t(), torch.zeros(2, dtype=torch.long), 1.0, torch.empty(2, 4))


def _loss_inputs(dtype, dev, *, nan_padding=False, vocab=37):
    logits, targets, mask, old, ref, adv = make_inputs(seed=3, rows=3, cols=7, vocab=vocab, dtype=dtype)
    if nan_padding:  # padding positions may hold anything: the gradient must still be 0 there
        logits = torch.where(mask[..., None], logits, torch.full_like(logits, float("nan")))
    logits, targets, mask, old, ref, adv = _to(dev, logits, targets, mask, old, ref, adv)
    inputs = LossInputs(targets=targets, old_logp=old, advantages=adv, mask=mask, ref_logp=ref)
    return logits, inputs, (targets, mask, old, ref, adv)


def _run(logits, inputs, cfg, **options):
    x = logits.clone().requires_grad_()
    out, stats = fused_policy_loss(x, inputs, cfg, VocabParallelOptions(**options))
    out.loss_sum.backward()
    return out, stats, x.grad


@pytest.mark.parametrize("cfg", [ENTROPY, NO_ENTROPY], ids=["entropy", "no_entropy"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("vocab_size", [None, 33], ids=["no_padding", "tp_padding"])
@pytest.mark.parametrize("chunk_tokens", [None, 5])
def test_fused_loss_triton_matches_torch_and_float64(dev, cfg, temperature, vocab_size, chunk_tokens):
    logits, inputs, ref_args = _loss_inputs(torch.float32, dev, nan_padding=True)
    if vocab_size is not None:  # Megatron pads the vocabulary; padded columns hold junk
        logits[..., vocab_size:] = 50.0
        inputs.targets.clamp_(max=vocab_size - 1)
    opts = dict(temperature=temperature, vocab_size=vocab_size, chunk_tokens=chunk_tokens, token_grad_norms=True)
    got, got_stats, got_grad = _run(logits, inputs, cfg, kernel="triton", **opts)
    want, want_stats, want_grad = _run(logits, inputs, cfg, kernel="torch", **opts)
    torch.testing.assert_close(got.loss_sum, want.loss_sum, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_stats.logit_grad_norm, want_stats.logit_grad_norm, rtol=1e-5, atol=1e-6)
    mask = inputs.mask
    assert (got_grad[~mask] == 0).all() and torch.isfinite(got_grad).all()
    if vocab_size is not None:
        assert (got_grad[..., vocab_size:] == 0).all()
    # ... and both agree with the loss written out in float64 (padding positions zeroed first).
    clean = torch.where(mask[..., None], logits.double(), torch.zeros((), dtype=torch.float64))
    loss64, grad64, *_ = naive_loss(clean, *ref_args, cfg, temperature=temperature, vocab_size=vocab_size)
    count = got.count.double()
    torch.testing.assert_close(got.loss_sum.double() / count, loss64, rtol=1e-5, atol=1e-6)
    if vocab_size is not None:
        grad64[..., vocab_size:] = 0
    torch.testing.assert_close(got_grad.double() / count, grad64, rtol=1e-4, atol=1e-6)


def test_bf16_logits_get_a_bf16_gradient_equal_to_the_torch_kernel(dev):
    """bf16 logits: Triton writes the bf16 gradient directly; the torch kernel computes it in
    float32 and rounds, so the two may differ by one bf16 rounding of the same float32 value."""
    logits, inputs, _ = _loss_inputs(torch.bfloat16, dev)
    got, _, got_grad = _run(logits, inputs, ENTROPY, kernel="triton")
    want, _, want_grad = _run(logits, inputs, ENTROPY, kernel="torch")
    assert got_grad.dtype == torch.bfloat16
    torch.testing.assert_close(got.loss_sum, want.loss_sum, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_grad.float(), want_grad.float(), rtol=8e-3, atol=1e-6)


def test_forward_only_logprobs_match(dev):
    logits, inputs, _ = _loss_inputs(torch.float32, dev)
    got = vocab_parallel_logprobs(logits, inputs.targets, mask=inputs.mask, options=VocabParallelOptions(kernel="triton"))
    want = vocab_parallel_logprobs(logits, inputs.targets, mask=inputs.mask, options=VocabParallelOptions(kernel="torch"))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_linear_mode_matches_the_torch_kernel(dev, dtype):
    """The lm-head mode: each chunk's fresh logits are overwritten by their gradient in place."""
    _, inputs, _ = _loss_inputs(torch.float32, dev)
    inputs.targets.clamp_(max=34)  # vocab_size=35 below: two TP padding rows in the lm-head
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(3, 7, 16, generator=g).to(dtype).to(dev)
    weight = (0.5 * torch.randn(37, 16, generator=g)).to(dtype).to(dev)

    def run(kernel):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        opts = VocabParallelOptions(kernel=kernel, chunk_tokens=4, vocab_size=35, token_grad_norms=True)
        out, stats = fused_linear_policy_loss(h, w, inputs, ENTROPY, opts)
        out.loss_sum.backward()
        return out.loss_sum, stats.logit_grad_norm, h.grad, w.grad

    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
    for a, b in zip(run("triton"), run("torch"), strict=True):
        torch.testing.assert_close(a.float(), b.float(), **tol)


def test_kernel_choice_and_its_errors(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cpu = torch.zeros(2, 3)
    assert vp.resolve_kernel("auto", cpu) == "torch"  # no CUDA tensor
    assert vp.resolve_kernel("torch", cpu) == "torch"
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        vp.resolve_kernel("triton", cpu)
    with pytest.raises(ValueError, match="float64"):
        vp.resolve_kernel("triton", cpu.double())
    with pytest.raises(ValueError, match="kernel must be one of"):
        VocabParallelOptions(kernel="cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert vp.resolve_kernel("triton", cpu) == "triton"
    assert vp.resolve_kernel("auto", cpu) == "torch"  # auto never picks the interpreter
