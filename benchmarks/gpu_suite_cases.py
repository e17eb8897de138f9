"""The GPU suite's cases (``benchmarks/gpu_suite.py`` runs them; its docstring describes
each): the fused loss, the fused lm-head, the Megatron actor's train step, the HF engine
and the log-prob agreement. Each takes the :class:`~gpu_suite_harness.Suite` and reports
through ``suite.emit``; a raised exception fails the case.
"""

from __future__ import annotations

import importlib.util
import math
import os
import time

from gpu_suite_harness import Suite, _dtype, _is_oom, _median

# ----------------------------------------------------------------------------- case 1: the fused loss


def _loss_inputs(num_tokens: int, vocab: int, device: str):
    import torch

    from megatron_rl.ops import LossInputs

    g = torch.Generator().manual_seed(1234)
    targets = torch.randint(0, vocab, (num_tokens,), generator=g)
    old_logp = -torch.rand(num_tokens, generator=g) * 12
    ref_logp = old_logp + 0.1 * torch.randn(num_tokens, generator=g)
    adv = torch.randn(num_tokens, generator=g)
    mask = torch.ones(num_tokens, dtype=torch.bool)
    mask[-num_tokens // 16 :] = False  # some padding, as in a real micro-batch
    to = lambda t: t.to(device)  # noqa: E731
    return LossInputs(
        targets=to(targets), old_logp=to(old_logp), advantages=to(adv), mask=to(mask), ref_logp=to(ref_logp)
    )


def case_loss(suite: Suite) -> None:
    import torch
    from entropy_baseline import entropy_one_buffer  # the strong separate entropy pass (one softmax buffer)
    from fused_loss import _config  # the CPU benchmark's loss: PPO-clip + k3 KL 0.001 + entropy 0.001
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from megatron_rl.algo import compute_policy_loss
    from megatron_rl.ops import VocabParallelOptions, fused_policy_loss
    from megatron_rl.ops.vocab_parallel import resolve_kernel

    suite.ensure_dist()
    s = suite.sizes
    cfg, dt, vocab = _config(), _dtype(s.loss_dtype), s.vocab
    elt = torch.finfo(dt).bits // 8
    bw = suite.calib["copy_bytes_per_s"]
    checked = False
    for num_tokens in s.loss_tokens:
        est = 18 * num_tokens * vocab * elt / 2e12 + 5  # generous: the three methods, all repeats
        if suite.case_remaining() < est:
            suite.emit("loss", f"T={num_tokens}", "skipped", tokens=num_tokens, reason="time budget")
            continue
        inputs = _loss_inputs(num_tokens, vocab, suite.device)
        g = torch.Generator(device=suite.device).manual_seed(7)
        logits = torch.empty(num_tokens, vocab, dtype=dt, device=suite.device)
        logits.normal_(generator=g).mul_(3.0)
        logits.requires_grad_()
        opts = VocabParallelOptions()  # kernel "auto": Triton on CUDA
        torch_opts = VocabParallelOptions(kernel="torch")  # the chunked torch kernel, for comparison

        def fused(opts=opts):
            out, _ = fused_policy_loss(logits, inputs, cfg, opts)
            out.loss_sum.backward()
            return out.loss_sum.detach()

        def fused_torch():
            return fused(torch_opts)

        def megatron():
            entropy = entropy_one_buffer(logits)  # before CE, as in fused_loss.py
            logp = -vocab_parallel_cross_entropy(logits, inputs.targets)
            out = compute_policy_loss(
                logp, inputs.old_logp, inputs.advantages, inputs.mask, cfg, ref_logp=inputs.ref_logp, entropy=entropy
            )
            out.loss_sum.backward()
            return out.loss_sum.detach()

        def reset():
            logits.grad = None

        logits_bytes = num_tokens * vocab * elt
        floor_bytes = num_tokens * vocab * (elt + elt)  # read logits once + write the gradient once
        results = {}
        kernel = resolve_kernel(opts.kernel, logits)
        for name, fn in (("fused", fused), ("fused[torch kernel]", fused_torch), ("megatron_ce+entropy", megatron)):
            def agreement(name=name, fn=fn):  # one check at the first size: losses and gradients
                if not checked:
                    reset()
                    results[name] = (float(fn()), logits.grad.float().clone())

            measured = suite.measure("loss", f"{name} T={num_tokens}", fn, reset=reset, before=agreement,
                                     method=name, tokens=num_tokens, vocab=vocab)  # fmt: skip
            if measured is None:
                continue
            times, peak = measured
            t = _median(times)
            floor_s = floor_bytes / bw
            suite.emit(
                "loss", f"{name} T={num_tokens}", method=name, tokens=num_tokens, vocab=vocab, dtype=s.loss_dtype,
                kernel={"fused": kernel, "fused[torch kernel]": "torch"}.get(name),
                fwd_bwd_s=t, fwd_bwd_s_all=times, logits_bytes=logits_bytes, peak_extra_bytes=peak,
                peak_extra_x_logits=None if peak is None else peak / logits_bytes,
                floor_bytes=floor_bytes, floor_s=floor_s, x_floor=t / floor_s,
                x_floor_two_pass=t / (floor_bytes * 1.5 / bw), effective_gb_per_s=floor_bytes / t / 1e9,
                table={
                    "method": name, "T": f"{num_tokens:,}", "fwd+bwd ms": f"{t * 1e3:.2f}",
                    "peak extra": "-" if peak is None else f"{peak / 2**30:.2f} GiB ({peak / logits_bytes:.2f}x logits)",
                    "x HBM floor (4TV B)": f"{t / floor_s:.2f}", "x two-pass floor (6TV B)": f"{t / (floor_bytes * 1.5 / bw):.2f}",
                },
            )  # fmt: skip
        if not checked and len(results) == 3:
            (lf, gf), (lm, gm) = results["fused"], results["megatron_ce+entropy"]
            lt, gt = results["fused[torch kernel]"]
            grad_diff = None if gf is None or gm is None else float((gf - gm).abs().max())
            kernel_grad_diff = None if gf is None or gt is None else float((gf - gt).abs().max())
            grad_scale = None if gm is None else float(gm.abs().max())
            suite.emit(
                "loss", f"agreement T={num_tokens}", tokens=num_tokens, loss_fused=lf, loss_megatron=lm,
                loss_rel_diff=abs(lf - lm) / max(abs(lm), 1e-12), grad_max_abs_diff=grad_diff, grad_max_abs=grad_scale,
                kernel=kernel, loss_rel_diff_vs_torch_kernel=abs(lf - lt) / max(abs(lt), 1e-12),
                grad_max_abs_diff_vs_torch_kernel=kernel_grad_diff,
                table={"method": "fused vs megatron", "T": f"{num_tokens:,}",
                       "fwd+bwd ms": f"loss rel diff {abs(lf - lm) / max(abs(lm), 1e-12):.1e}",
                       "peak extra": f"grad max diff {grad_diff:.1e} (max {grad_scale:.1e})" if grad_diff is not None else "-"},
            )  # fmt: skip
            checked = True
        logits = inputs = results = None  # free before the next size
        suite.free()


# ----------------------------------------------------------------------------- case 2: fused lm-head


def case_linear(suite: Suite) -> None:
    import torch
    from fused_loss import _config

    from megatron_rl.ops import VocabParallelOptions, fused_linear_policy_loss, fused_policy_loss

    s = suite.sizes
    cfg, dt, vocab, hidden_size = _config(), _dtype(s.loss_dtype), s.vocab, s.linear_hidden
    gemm_peak = suite.calib["gemm_flops_per_s"]
    g = torch.Generator(device=suite.device).manual_seed(11)
    weight = torch.empty(vocab, hidden_size, dtype=dt, device=suite.device).normal_(generator=g).mul_(0.02)
    weight.requires_grad_()
    main_grad = torch.zeros(vocab, hidden_size, dtype=torch.float32, device=suite.device)
    opts = VocabParallelOptions()  # kernel "auto": Triton on CUDA
    torch_opts = VocabParallelOptions(kernel="torch")
    for num_tokens in s.loss_tokens:
        useful = 6.0 * num_tokens * hidden_size * vocab  # forward + the two gradient matmuls
        est = 4 * 8.0 * num_tokens * hidden_size * vocab * (s.repeats + s.warmup) / gemm_peak + 5
        if suite.case_remaining() < est:
            suite.emit("linear", f"T={num_tokens}", "skipped", tokens=num_tokens, reason="time budget")
            continue
        inputs = _loss_inputs(num_tokens, vocab, suite.device)
        hidden = torch.empty(num_tokens, hidden_size, dtype=dt, device=suite.device).normal_(generator=g)
        hidden.requires_grad_()

        def fused_linear(opts=opts):
            out, _ = fused_linear_policy_loss(hidden, weight, inputs, cfg, opts, weight_main_grad=main_grad)
            out.loss_sum.backward()

        def fused_linear_torch():
            fused_linear(torch_opts)

        def unfused():
            logits = hidden @ weight.t()
            out, _ = fused_policy_loss(logits, inputs, cfg, opts)
            out.loss_sum.backward()

        def reset():
            hidden.grad = None
            weight.grad = None
            main_grad.zero_()

        fused_flops = 8.0 * num_tokens * hidden_size * vocab
        for name, fn, flops in (("fused_linear", fused_linear, fused_flops),
                                ("fused_linear[torch kernel]", fused_linear_torch, fused_flops),
                                ("unfused (hidden @ W^T, fused loss)", unfused, useful)):  # fmt: skip
            measured = suite.measure("linear", f"{name} T={num_tokens}", fn, reset=reset, method=name,
                                     tokens=num_tokens)  # fmt: skip
            if measured is None:
                continue
            times, peak = measured
            t = _median(times)
            logits_bytes = num_tokens * vocab * torch.finfo(dt).bits // 8
            suite.emit(
                "linear", f"{name} T={num_tokens}", method=name, tokens=num_tokens, vocab=vocab, hidden=hidden_size,
                dtype=s.loss_dtype, fwd_bwd_s=t, fwd_bwd_s_all=times, matmul_flops=flops, useful_flops=useful,
                useful_tflops_per_s=useful / t / 1e12, x_gemm_floor=t / (useful / gemm_peak),
                logits_bytes=logits_bytes, peak_extra_bytes=peak,
                peak_extra_x_logits=None if peak is None else peak / logits_bytes,
                table={
                    "method": name, "T": f"{num_tokens:,}", "fwd+bwd ms": f"{t * 1e3:.1f}",
                    "useful TFLOP/s (6THV)": f"{useful / t / 1e12:.1f}", "x GEMM floor": f"{t / (useful / gemm_peak):.2f}",
                    "peak extra": "-" if peak is None else f"{peak / 2**30:.2f} GiB ({peak / logits_bytes:.2f}x logits)",
                },
            )  # fmt: skip
        hidden = inputs = None
        suite.free()
    weight = main_grad = None  # noqa: F841
    suite.free()


# ----------------------------------------------------------------------------- case 3: the actor


def _actor(
    suite: Suite, architecture, *, dtype: str, use_te: bool, microbatch_tokens: int, kl: bool = False,
    lora_rank: int | None = None,
):  # fmt: skip
    from megatron_rl.actor.actor import MegatronActor
    from megatron_rl.actor.spec import ActorSpec
    from megatron_rl.algo import AlgorithmConfig
    from megatron_rl.config.model import ModelOptions
    from megatron_rl.config.parallel import ParallelConfig
    from megatron_rl.config.trainer import ActorConfig, LoRAConfig, TrainerConfig

    suite.ensure_dist()
    suite._dist = False  # the actor re-initialises megatron's parallel state itself
    return MegatronActor(
        ActorSpec(
            architecture=architecture,
            parallel=ParallelConfig(num_actor_ranks=1),
            model=ModelOptions(dtype=dtype, use_te=use_te),
            trainer=TrainerConfig(lr=1e-6, max_tokens_per_microbatch=microbatch_tokens),
            algorithm=AlgorithmConfig(kl_coef=0.001 if kl else 0.0),
            actor=ActorConfig(lora=None if lora_rank is None else LoRAConfig(rank=lora_rank, alpha=2.0 * lora_rank)),
        )
    )


def case_actor(suite: Suite) -> None:
    import torch
    from actor_throughput import PEAK_BF16, matmul_params, step_flops

    from megatron_rl.actor.batch import ActorBatch

    s = suite.sizes
    cfg = s.model
    te_reason = None
    if not suite.cuda:
        te_reason = "Transformer Engine needs CUDA"
    elif importlib.util.find_spec("transformer_engine") is None:
        te_reason = "transformer_engine is not importable on this machine"
    # "lora": the local spec with rank-16 adapters on every linear (docs/lora.md): memory and
    # time against the full-parameter "local" row of the same run.
    for spec_name in ("local", "te", "lora"):
        if spec_name == "te" and te_reason:
            suite.emit(
                "actor",
                "te spec",
                "skipped",
                reason=te_reason,
                table={"spec": "TE", "tokens/s": f"skipped: {te_reason}"},
            )
            continue
        if suite.case_remaining() < 20:
            suite.emit("actor", f"{spec_name} spec", "skipped", reason="time budget")
            continue
        budget = s.actor_microbatch_tokens
        n, length = s.actor_sequences, s.actor_seq_len
        oom_retries = 0
        while True:
            actor = None
            try:
                t0 = time.perf_counter()
                actor = _actor(
                    suite, dict(cfg), dtype=s.actor_dtype, use_te=spec_name == "te", microbatch_tokens=budget,
                    lora_rank=16 if spec_name == "lora" else None,
                )  # fmt: skip
                build_s = time.perf_counter() - t0
                g = torch.Generator().manual_seed(0)
                ids = torch.randint(0, cfg["vocab_size"], (n, length), generator=g)
                attn = torch.ones(n, length, dtype=torch.long)
                loss_mask = attn.clone()
                loss_mask[:, : length // 4] = 0  # a quarter prompt, three quarters response
                t0 = time.perf_counter()
                old = actor.compute_logprobs(ActorBatch(input_ids=ids, attention_mask=attn)).logp
                suite.sync()
                logprob_s = time.perf_counter() - t0
                batch = ActorBatch(input_ids=ids, attention_mask=attn, loss_mask=loss_mask, old_logp=old,
                                   advantages=torch.randn(n, length, generator=g))  # fmt: skip
                base = suite.reset_peak()
                metrics = {}

                def step(metrics=metrics):
                    metrics.update(actor.train_step(batch))

                # the first step allocates Adam's state: warm-up
                times = suite.timed(step, warmup=1, repeats=s.actor_steps)
                peak = suite.peak_since(base)
                trainable = sum(p.numel() for p in actor.model.parameters() if p.requires_grad)
                break
            except Exception as exc:  # noqa: BLE001
                if not (_is_oom(exc) and oom_retries < 2 and budget > length):
                    raise
                oom_retries += 1
                budget //= 2
            finally:
                del actor
                suite.free()
        step_s = _median(times)
        tokens = n * length
        flops = step_flops(cfg, tokens, length)
        measured = suite.calib["gemm_flops_per_s"] if s.gemm_dtype == s.actor_dtype else None
        sheet = next((v for k, v in PEAK_BF16.items() if k in suite.common["device_name"]), None)
        sheet = sheet if s.actor_dtype == "bfloat16" else None
        params = matmul_params(cfg) + (0 if cfg["tie_word_embeddings"] else cfg["vocab_size"] * cfg["hidden_size"])
        mfu = flops / step_s / measured if measured else None
        suite.emit(
            "actor", f"{spec_name} spec", spec=spec_name, dtype=s.actor_dtype, params=params,
            trainable_params=trainable,
            layers=cfg["num_hidden_layers"], hidden=cfg["hidden_size"], vocab=cfg["vocab_size"],
            sequences=n, seq_len=length, tokens_per_step=tokens, microbatch_tokens=budget, oom_retries=oom_retries,
            microbatches=metrics.get("actor/num_microbatches"), build_s=build_s, compute_logprobs_s=logprob_s,
            step_s=step_s, step_s_all=times, tokens_per_s=tokens / step_s, model_flops_per_step=flops,
            model_tflops_per_s=flops / step_s / 1e12, mfu_vs_measured_gemm=mfu,
            mfu_vs_datasheet=flops / step_s / sheet if sheet else None, loss=metrics.get("loss/total"),
            grad_norm=metrics.get("actor/grad_norm"), step_skipped=metrics.get("actor/step_skipped"),
            peak_memory_bytes=None if peak is None else peak + base, loss_impl="fused_linear",
            table={
                "spec": spec_name, "params": f"{params / 1e9:.2f}B", "tokens/step": f"{tokens:,}",
                "step s": f"{step_s:.3f}", "tokens/s": f"{tokens / step_s:,.0f}",
                "model TFLOP/s": f"{flops / step_s / 1e12:.1f}",
                "MFU (measured GEMM peak)": "-" if mfu is None else f"{mfu:.1%}",
                "peak GiB": "-" if peak is None else f"{(peak + base) / 2**30:.1f}",
            },
        )  # fmt: skip
        for key in ("loss", "grad_norm"):
            if not math.isfinite(float(suite.records[-1][key])):
                raise RuntimeError(f"actor train step gave a non-finite {key}: {suite.records[-1][key]}")


# ----------------------------------------------------------------------------- case 4: the HF engine


def case_engine(suite: Suite) -> None:
    import torch

    from megatron_rl.rollout import SamplingParams
    from megatron_rl.rollout.engines.hf import HFEngine

    s = suite.sizes
    t0 = time.perf_counter()
    path = suite.hf_model_dir()
    save_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine = HFEngine(path, device=suite.device, dtype=s.engine_dtype)
    load_s = time.perf_counter() - t0
    try:
        g = torch.Generator().manual_seed(1)
        prompts = torch.randint(0, s.model["vocab_size"], (s.engine_prompts, s.engine_prompt_len), generator=g).tolist()
        params = SamplingParams(n=s.engine_samples, temperature=1.0, max_new_tokens=s.engine_new_tokens, seed=3)
        counts = []

        def call():
            counts.append(sum(len(c.token_ids) for grp in engine.generate(prompts, params) for c in grp))

        base = suite.reset_peak()
        times = suite.timed(call, warmup=1, repeats=max(1, s.repeats // 2))
        peak = suite.peak_since(base)
    finally:
        engine.shutdown()
        engine = None  # noqa: F841
        suite.free()
    t = _median(times)
    tokens = counts[-1]
    rows = s.engine_prompts * s.engine_samples
    suite.emit(
        "engine", "hf", engine="HFEngine", dtype=s.engine_dtype, prompts=s.engine_prompts, samples=s.engine_samples,
        prompt_len=s.engine_prompt_len, max_new_tokens=s.engine_new_tokens, generated_tokens=tokens,
        generate_s=t, generate_s_all=times, tokens_per_s=tokens / t, ms_per_decode_step=t / s.engine_new_tokens * 1e3,
        checkpoint_save_s=save_s, engine_load_s=load_s, peak_extra_bytes=peak,
        table={"engine": "HFEngine", "rows x new tokens": f"{rows} x {s.engine_new_tokens}",
               "s / call": f"{t:.2f}", "ms / decode step": f"{t / s.engine_new_tokens * 1e3:.1f}",
               "tokens/s": f"{tokens / t:,.0f}"},
    )  # fmt: skip


# ----------------------------------------------------------------------------- case 5: log-prob agreement


def case_logprob(suite: Suite) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_rl.actor.batch import ActorBatch

    s = suite.sizes
    path = suite.hf_model_dir()
    n, length = s.logprob_batch
    vocab = s.model["vocab_size"]
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, vocab, (n, length), generator=g)
    attn = torch.ones(n, length, dtype=torch.long)

    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation="eager")
        with torch.no_grad():
            logits = ref_model(input_ids=ids).logits[:, :-1]
        del ref_model
        lsm = torch.log_softmax(logits, dim=-1)
        del logits
        ref_logp = lsm.gather(-1, ids[:, 1:, None]).squeeze(-1)
        ref_ent = -(lsm.exp() * lsm).sum(-1)
        del lsm
    finally:
        torch.set_num_threads(threads)
    ref_s = time.perf_counter() - t0
    failures = []
    for dtype, tol in (("float32", s.fp32_logp_tol), ("bfloat16", s.bf16_logp_tol)):
        actor = _actor(suite, str(path), dtype=dtype, use_te=False, microbatch_tokens=n * length)
        try:
            actor.load_hf_weights(path)
            lp = actor.compute_logprobs(ActorBatch(input_ids=ids, attention_mask=attn))
        finally:
            del actor
            suite.free()
        d_logp = (lp.logp[:, 1:].double() - ref_logp).abs()
        d_ent = (lp.entropy[:, 1:].double() - ref_ent).abs()
        ok = bool(d_logp.max() <= tol)
        if not ok:
            failures.append(f"{dtype}: max |dlogp| {float(d_logp.max()):.3g} > {tol}")
        suite.emit(
            "logprob", dtype, "ok" if ok else "failed", actor_dtype=dtype, reference="transformers float64 on CPU",
            sequences=n, seq_len=length, vocab=vocab, layers=s.model["num_hidden_layers"],
            max_abs_dlogp=float(d_logp.max()), mean_abs_dlogp=float(d_logp.mean()),
            max_abs_dentropy=float(d_ent.max()), mean_abs_dentropy=float(d_ent.mean()),
            ref_logp_mean=float(ref_logp.mean()), ref_entropy_mean=float(ref_ent.mean()), tolerance=tol,
            within_tolerance=ok, reference_s=ref_s, loss_impl="fused_linear",
            table={"actor dtype": dtype, "tokens": f"{n} x {length}", "max |dlogp|": f"{float(d_logp.max()):.2e}",
                   "mean |dlogp|": f"{float(d_logp.mean()):.2e}", "max |dH|": f"{float(d_ent.max()):.2e}",
                   "tolerance": f"{tol:g}", "ok": "yes" if ok else "NO"},
        )  # fmt: skip
    if failures:
        raise AssertionError("log-prob agreement outside tolerance: " + "; ".join(failures))
