"""The GPU suite's mixture-of-experts case (``benchmarks/gpu_suite.py --cases moe``).

(a) The experts' GEMMs of one MoE layer, forward + backward, two ways on the same routed
tokens and weights: one matmul pair per expert in turn (what megatron-core's
``SequentialMLP``, the local spec's experts, does) and torch's grouped GEMM
(``torch.nn.functional.grouped_mm``: every expert's tokens in one kernel, the kind of
kernel TE's ``GroupedLinear`` gives megatron's ``TEGroupedMLP``). The outputs and the
gradients of the tokens and of both weights are compared. Megatron's grouped experts need
Transformer Engine, which the GPU machines lack, so this measures what grouping would save.
(b) The Megatron actor's train step on a Qwen3-MoE (local spec, sequential experts, EP = 1
on the one GPU): tokens/s, model FLOP/s from the active parameters, peak memory.
"""

from __future__ import annotations

import math
import time

from gpu_suite_cases import _actor
from gpu_suite_harness import Suite, _dtype, _median


def _routed(suite: Suite, gemm: dict):
    """Tokens already permuted by expert (``[T*k, H]``, expert-major, as a token dispatcher
    leaves them), the per-expert counts, and the SwiGLU experts' weights in nn.Linear's
    layout: ``fc1 [E, 2F, H]``, ``fc2 [E, H, F]``."""
    import torch

    t, k, e, h, f = gemm["tokens"], gemm["topk"], gemm["experts"], gemm["hidden"], gemm["width"]
    dt, dev = _dtype(gemm["dtype"]), suite.device
    g = torch.Generator().manual_seed(11)
    experts = torch.rand(t, e, generator=g).topk(k, dim=-1).indices.flatten()  # random top-k routing
    counts = torch.bincount(experts, minlength=e)
    x = torch.randn(t * k, h, generator=g).to(dev, dt).requires_grad_()
    fc1 = (torch.randn(e, 2 * f, h, generator=g) / math.sqrt(h)).to(dev, dt).requires_grad_()
    fc2 = (torch.randn(e, h, f, generator=g) / math.sqrt(f)).to(dev, dt).requires_grad_()
    return x, counts, fc1, fc2


def _swiglu(h):
    import torch

    gate, up = h.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _sequential(x, counts, fc1, fc2):
    import torch

    out, start = [], 0
    for i, n in enumerate(counts.tolist()):
        xi = x[start : start + n]
        out.append(_swiglu(xi @ fc1[i].t()) @ fc2[i].t())
        start += n
    return torch.cat(out)


def _grouped(x, counts, fc1, fc2):
    import torch
    from torch.nn.functional import grouped_mm

    offs = torch.cumsum(counts, 0).to(device=x.device, dtype=torch.int32)
    # mat_b as [E, K, N] views of the [E, N, K] weights: the column-major operand the kernel wants
    return grouped_mm(_swiglu(grouped_mm(x, fc1.transpose(-2, -1), offs=offs)), fc2.transpose(-2, -1), offs=offs)


def _gemm_case(suite: Suite) -> None:
    import torch

    gemm = suite.sizes.moe["gemm"]
    if not hasattr(torch.nn.functional, "grouped_mm"):
        suite.emit("moe", "expert gemms", "skipped", reason=f"torch {torch.__version__} has no grouped_mm")
        return
    x, counts, fc1, fc2 = _routed(suite, gemm)
    grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(12)).to(x.device, x.dtype)
    results, times, peaks = {}, {}, {}
    for name, fn in (("sequential", _sequential), ("grouped", _grouped)):

        def step(fn=fn):
            for p in (x, fc1, fc2):
                p.grad = None
            y = fn(x, counts, fc1, fc2)
            y.backward(grad_out)
            return y

        y = step()
        results[name] = [t.detach().float() for t in (y, x.grad, fc1.grad, fc2.grad)]
        base = suite.reset_peak()
        times[name] = suite.timed(step)
        peak = suite.peak_since(base)
        peaks[name] = peak
    diff = {label: ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
            for label, a, b in zip(("out", "dx", "dfc1", "dfc2"), results["grouped"], results["sequential"])}  # fmt: skip
    t, k, h, f = gemm["tokens"], gemm["topk"], gemm["hidden"], gemm["width"]
    flops = 3 * 2 * t * k * (h * 2 * f + f * h)  # forward + backward (2x) of both matmuls
    seq_s, grp_s = _median(times["sequential"]), _median(times["grouped"])
    suite.emit(
        "moe", "expert gemms", tokens=t, topk=k, experts=gemm["experts"], hidden=h, width=f, dtype=gemm["dtype"],
        tokens_per_expert_min=int(counts.min()), tokens_per_expert_max=int(counts.max()), flops=flops,
        sequential_s=seq_s, grouped_s=grp_s, sequential_s_all=times["sequential"], grouped_s_all=times["grouped"],
        grouped_speedup=seq_s / grp_s, max_rel_diff=diff, peak_extra_bytes=peaks,
        table={
            "shape": f"{t:,} tokens x top-{k} of {gemm['experts']} experts, H {h}, F {f}, {gemm['dtype']}",
            "sequential ms": f"{seq_s * 1e3:.2f} ({flops / seq_s / 1e12:.1f} TFLOP/s)",
            "grouped ms": f"{grp_s * 1e3:.2f} ({flops / grp_s / 1e12:.1f} TFLOP/s)",
            "grouped speed-up": f"{seq_s / grp_s:.2f}x",
            "max rel. diff (out, dx, dW)": ", ".join(f"{v:.1e}" for v in diff.values()),
        },
    )  # fmt: skip


def _actor_case(suite: Suite) -> None:
    import torch

    from megatron_rl.actor.batch import ActorBatch
    from megatron_rl.cluster.planner import Architecture

    m = suite.sizes.moe
    cfg, n, length = m["model"], m["sequences"], m["seq_len"]
    actor = None
    try:
        t0 = time.perf_counter()
        actor = _actor(suite, dict(cfg), dtype=m["dtype"], use_te=False, microbatch_tokens=m["microbatch_tokens"])
        build_s = time.perf_counter() - t0
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, cfg["vocab_size"], (n, length), generator=g)
        attn = torch.ones(n, length, dtype=torch.long)
        loss_mask = attn.clone()
        loss_mask[:, : length // 4] = 0
        old = actor.compute_logprobs(ActorBatch(input_ids=ids, attention_mask=attn)).logp
        batch = ActorBatch(input_ids=ids, attention_mask=attn, loss_mask=loss_mask, old_logp=old,
                           advantages=torch.randn(n, length, generator=g))  # fmt: skip
        base = suite.reset_peak()
        metrics = {}
        times = suite.timed(lambda a=actor: metrics.update(a.train_step(batch)), warmup=1, repeats=m["steps"])
        peak = suite.peak_since(base)
        total = sum(p.numel() for p in actor.model_chunks[0].parameters())
    finally:
        del actor
        suite.free()
    step_s, tokens = _median(times), n * length
    _, active = Architecture.from_hf_config(cfg).parameters()  # the planner's count (one copy of each tensor)
    # A token multiplies with its active parameters but the input embedding (a lookup; the
    # norms' few weights are counted too), plus attention's scores and values.
    matmul = active - (0 if cfg["tie_word_embeddings"] else cfg["vocab_size"] * cfg["hidden_size"])
    head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    flops = 6.0 * matmul * tokens + 6.0 * cfg["num_hidden_layers"] * length * cfg["num_attention_heads"] * head * tokens
    measured = suite.calib.get("gemm_flops_per_s") if suite.sizes.gemm_dtype == m["dtype"] else None
    for key in ("loss/total", "actor/grad_norm"):
        if not math.isfinite(float(metrics.get(key, float("nan")))):
            raise RuntimeError(f"MoE train step gave a non-finite {key}: {metrics.get(key)}")
    suite.emit(
        "moe", "actor step", spec="local", experts="sequential", dtype=m["dtype"], params=total,
        active_params=active, sequences=n, seq_len=length, tokens_per_step=tokens,
        build_s=build_s, step_s=step_s, step_s_all=times, tokens_per_s=tokens / step_s,
        model_tflops_per_s=flops / step_s / 1e12, mfu_vs_measured_gemm=flops / step_s / measured if measured else None,
        loss=metrics.get("loss/total"), load_balancing_loss=metrics.get("moe/load_balancing_loss"),
        peak_memory_bytes=None if peak is None else peak + base,
        table={
            "shape": f"{total / 1e9:.2f}B params ({active / 1e9:.2f}B active), "
                     f"{cfg['num_experts']} experts top-{cfg['num_experts_per_tok']}, {tokens:,} tokens, {m['dtype']}",
            "sequential ms": f"{step_s * 1e3:.0f} ({tokens / step_s:,.0f} tokens/s, {flops / step_s / 1e12:.1f} TFLOP/s)",
            "grouped ms": "needs Transformer Engine (TEGroupedMLP)",
            "peak GiB": "-" if peak is None else f"{(peak + base) / 2**30:.1f}",
        },
    )  # fmt: skip


def moe_sizes(*, experts: int, topk: int, hidden: int, width: int, attention: tuple[int, int, int], vocab: int,
              gemm_tokens: int, batch: tuple[int, int, int, int], actor_dtype: str) -> dict:  # fmt: skip
    """``Sizes.moe``: the expert GEMMs of one layer (bf16: torch's grouped_mm takes no float32
    on a CPU) and a two-layer Qwen3-MoE of the same experts. ``attention``: heads, KV
    heads, head size; ``batch``: sequences, sequence length, micro-batch tokens, steps."""
    heads, kv_heads, head_dim = attention
    sequences, seq_len, microbatch_tokens, steps = batch
    gemm = {"tokens": gemm_tokens, "topk": topk, "experts": experts, "hidden": hidden, "width": width,
            "dtype": "bfloat16"}  # fmt: skip
    model = {"model_type": "qwen3_moe", "hidden_act": "silu", "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6,
             "tie_word_embeddings": False, "norm_topk_prob": True, "hidden_size": hidden, "num_hidden_layers": 2,
             "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
             "num_experts": experts, "num_experts_per_tok": topk, "moe_intermediate_size": width,
             "intermediate_size": width, "vocab_size": vocab, "max_position_embeddings": 2 * seq_len}  # fmt: skip
    return {"gemm": gemm, "model": model, "sequences": sequences, "seq_len": seq_len,
            "microbatch_tokens": microbatch_tokens, "steps": steps, "dtype": actor_dtype}  # fmt: skip


def case_moe(suite: Suite) -> None:
    _gemm_case(suite)
    suite.free()
    _actor_case(suite)
