"""The one-call GPU suite: every GPU number the project reports, from one command on one GPU.

Runs from the source tree (``PYTHONPATH``), in one process, without Ray, vLLM or
Transformer Engine (each used only when importable), on one GPU with a world-1 process
group (NCCL; gloo on CPU). Every case prints JSON lines (device, torch version, sizes,
times, memory) and is wrapped on its own: a failing case records a ``"status":
"failed"`` line with the error and the others still run; the exit code is 1 when any
case failed. A time budget (``--budget-s``, default 480 s) keeps the whole suite inside
an 8-minute window: each case gets what is left minus a reserve for the cases after it,
and a case that runs over is interrupted and recorded as failed.

Cases (``--cases``, default all):

``loss``     fused policy loss (``megatron_rl.ops.fused_policy_loss``) vs megatron-core's
             ``vocab_parallel_cross_entropy`` + a separate entropy pass (``benchmarks/
             entropy_baseline.py``: a custom autograd function holding one float32 softmax
             buffer, as verl's entropy with its own backward), bf16 logits ``[T, 151936]``,
             T in {4k, 16k, 32k}: forward+backward time (CUDA events, warm-up, median),
             peak memory above the inputs, and the time over the HBM floor.
``linear``   the fused lm-head mode (``fused_linear_policy_loss``, H = 3584) vs the unfused
             path (``hidden @ W^T`` then the fused loss) at the same T: time, memory,
             useful TFLOP/s (6 T H V) and the time over the GEMM floor.
``actor``    the Megatron actor's ``train_step`` on a ~1B Qwen2-shaped random-init model
             (bf16, local spec; and the TE spec when ``transformer_engine`` imports, else a
             ``skipped`` line; and the local spec with rank-16 LoRA adapters on every
             linear, ``spec: lora``): tokens/s and MFU against the measured bf16 GEMM peak,
             peak memory, trainable parameters.
``engine``   the built-in HF engine (``megatron_rl.rollout.engines.hf.HFEngine``) on the same
             model: generated tokens/s.
``logprob``  log-prob agreement: the actor (fp32 and bf16) vs a float64 CPU ``transformers``
             forward of the same weights: max and mean ``|delta logp|`` (and entropy).
``moe``      one Qwen3-30B-A3B layer's expert GEMMs (128 experts, top-8, forward + backward)
             one expert at a time (megatron's ``SequentialMLP``) vs torch's grouped GEMM,
             outputs and gradients compared; the Megatron actor's train step on a two-layer
             Qwen3-MoE of that shape (local spec, EP = 1): tokens/s, TFLOP/s, memory.

Calibration (always, first): a large device-to-device ``copy_`` (bandwidth, counting bytes
read and written) and a large bf16 matmul (the measured GEMM peak).

HBM floor of the ``loss`` case: the op must at least read the logits once and write their
gradient once: ``floor_bytes = T * V * (bytes(logits) + bytes(grad))`` = ``4 T V`` for
bf16, ``floor_s = floor_bytes / copy_bandwidth``; ``x_floor = time / floor_s``. A
two-pass op (statistics, then the gradient, which needs each row's final log-sum-exp;
a 151,936-wide bf16 row does not fit in shared memory) reads the logits twice:
``x_floor_two_pass`` uses ``6 T V`` bytes.

    PYTHONPATH=$PWD python benchmarks/gpu_suite.py --out /tmp/gs              # on the GPU machine
    python benchmarks/gpu_suite.py --tiny --out /tmp/gs                       # toy sizes on CPU
    python benchmarks/gpu_suite.py --tiny --device cuda --out /tmp/gs         # toy sizes on the GPU
    python benchmarks/gpu_suite.py --cases loss linear --out /tmp/gs

docs/gpu.md has the device command (wheels carried in ``.gpu_wheels``, built by
``tools/gpu_wheelhouse.sh``). This file is the entry point (sizes, calibration, the table,
the command line); the machinery (output, timing, budget, shared state) is in
``gpu_suite_harness.py`` and the cases in ``gpu_suite_cases.py`` and ``gpu_suite_moe.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import platform
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for _p in (str(REPO), str(HERE)):  # the source tree and the sibling benchmarks (imported as modules)
    if _p not in sys.path:
        sys.path.insert(0, _p)

from gpu_suite_cases import case_actor, case_engine, case_linear, case_logprob, case_loss  # noqa: E402
from gpu_suite_harness import Suite, _dtype, _median  # noqa: E402
from gpu_suite_moe import case_moe, moe_sizes  # noqa: E402

CASES = ("loss", "linear", "actor", "engine", "logprob", "moe")


# ----------------------------------------------------------------------------- sizes


def qwen2(**kw) -> dict:
    base = {
        "model_type": "qwen2",
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rope_theta": 1_000_000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
    }
    return {**base, **kw}


@dataclass
class Sizes:
    """Every size of the suite; :func:`gpu_sizes` and :func:`tiny_sizes` give the two presets."""

    vocab: int
    loss_tokens: tuple[int, ...]
    loss_dtype: str
    linear_hidden: int
    model: dict
    actor_sequences: int
    actor_seq_len: int
    actor_microbatch_tokens: int
    actor_steps: int
    actor_dtype: str
    engine_prompts: int
    engine_samples: int
    engine_prompt_len: int
    engine_new_tokens: int
    engine_dtype: str
    logprob_batch: tuple[int, int]
    copy_bytes: int
    gemm_n: int
    gemm_dtype: str
    repeats: int = 5
    warmup: int = 2
    fp32_logp_tol: float = 1e-3
    bf16_logp_tol: float = 1.0
    moe: dict = field(default_factory=dict)
    """The ``moe`` case (gpu_suite_moe.py): ``gemm`` (tokens, topk, experts, hidden, width,
    dtype of one layer's expert GEMMs) and the actor's ``model`` (a Qwen3-MoE HF config),
    ``sequences``, ``seq_len``, ``microbatch_tokens``, ``steps``, ``dtype``."""
    reserve_s: dict = field(default_factory=dict)


def gpu_sizes() -> Sizes:
    from actor_throughput import QWEN2_1B  # hidden 2048, 16 layers, GQA 16/4, vocab 151936, tied: 1.03B

    return Sizes(
        vocab=151_936,
        loss_tokens=(4096, 16384, 32768),
        loss_dtype="bfloat16",
        linear_hidden=3584,
        model={**QWEN2_1B, "max_position_embeddings": 4096},
        actor_sequences=16,
        actor_seq_len=2048,
        actor_microbatch_tokens=4096,
        actor_steps=3,
        actor_dtype="bfloat16",
        engine_prompts=32,
        engine_samples=4,
        engine_prompt_len=128,
        engine_new_tokens=128,
        engine_dtype="bfloat16",
        logprob_batch=(4, 256),
        copy_bytes=2 << 30,
        gemm_n=8192,
        gemm_dtype="bfloat16",
        reserve_s={"loss": 30, "linear": 30, "actor": 60, "engine": 30, "logprob": 60, "moe": 60},
        # One layer of Qwen3-30B-A3B (128 experts of width 768, top-8); the actor: two such layers.
        moe=moe_sizes(experts=128, topk=8, hidden=2048, width=768, attention=(32, 4, 128), vocab=151_936,
                      gemm_tokens=16384, batch=(8, 2048, 4096, 3), actor_dtype="bfloat16"),  # fmt: skip
    )


def tiny_sizes() -> Sizes:
    return Sizes(
        vocab=1000,
        loss_tokens=(64, 256),
        loss_dtype="bfloat16",
        linear_hidden=64,
        model=qwen2(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=1000,
            max_position_embeddings=256,
        ),  # fmt: skip
        actor_sequences=4,
        actor_seq_len=32,
        actor_microbatch_tokens=64,
        actor_steps=2,
        actor_dtype="float32",
        engine_prompts=4,
        engine_samples=2,
        engine_prompt_len=8,
        engine_new_tokens=8,
        engine_dtype="float32",
        logprob_batch=(2, 16),
        copy_bytes=32 << 20,
        gemm_n=256,
        gemm_dtype="float32",
        repeats=2,
        warmup=1,
        reserve_s={c: 5 for c in CASES},
        moe=moe_sizes(experts=4, topk=2, hidden=64, width=32, attention=(4, 2, 16), vocab=1000,
                      gemm_tokens=64, batch=(4, 32, 64, 2), actor_dtype="float32"),  # fmt: skip
    )


# ----------------------------------------------------------------------------- calibration


def calibrate(suite: Suite) -> None:
    """Device-to-device copy bandwidth and the bf16 (fp32 on CPU) GEMM peak, measured here."""
    import torch

    s = suite.sizes
    n = s.copy_bytes // 4
    src = torch.empty(n, dtype=torch.float32, device=suite.device).uniform_()
    dst = torch.empty_like(src)
    copy_s = _median(suite.timed(lambda: dst.copy_(src), warmup=3, repeats=10))
    copy_bw = 2 * src.numel() * 4 / copy_s  # bytes read + written
    src = dst = None  # noqa: F841 -- free before the GEMM
    dt = _dtype(s.gemm_dtype)
    g = torch.Generator(device=suite.device).manual_seed(0)
    a = torch.randn(s.gemm_n, s.gemm_n, device=suite.device, dtype=dt, generator=g)
    b = torch.randn(s.gemm_n, s.gemm_n, device=suite.device, dtype=dt, generator=g)
    gemm_s = _median(suite.timed(lambda: a @ b, warmup=3, repeats=10))
    gemm_flops = 2 * s.gemm_n**3 / gemm_s
    a = b = None  # noqa: F841
    suite.free()
    suite.calib = {"copy_bytes_per_s": copy_bw, "gemm_flops_per_s": gemm_flops, "gemm_dtype": s.gemm_dtype}
    info = environment(suite)
    suite.emit(
        "calibration", None, copy_bytes=s.copy_bytes, copy_s=copy_s, copy_gb_per_s=copy_bw / 1e9,
        gemm_n=s.gemm_n, gemm_dtype=s.gemm_dtype, gemm_s=gemm_s, gemm_tflops=gemm_flops / 1e12,
        table={"copy GB/s (read+write)": f"{copy_bw / 1e9:,.0f}", f"{s.gemm_dtype} GEMM {s.gemm_n}^3 TFLOP/s": f"{gemm_flops / 1e12:,.1f}"},
        **info,
    )  # fmt: skip


def environment(suite: Suite) -> dict:
    import torch

    info = {
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
        "allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cpu_threads": torch.get_num_threads(),
    }
    for mod, key in (("megatron.core", "megatron_core"), ("transformers", "transformers"), ("triton", "triton")):
        try:
            info[key] = importlib.import_module(mod).__version__
        except Exception as exc:  # noqa: BLE001 -- reported, not fatal here
            info[key] = f"unavailable: {type(exc).__name__}: {exc}"
    info["transformer_engine"] = importlib.util.find_spec("transformer_engine") is not None
    if suite.cuda:
        props = torch.cuda.get_device_properties(suite.device)
        info["gpu_memory_gib"] = props.total_memory / 2**30
        info["sm_count"] = props.multi_processor_count
        info["capability"] = f"{props.major}.{props.minor}"
    return info


CASE_FNS = {
    "loss": case_loss,
    "linear": case_linear,
    "actor": case_actor,
    "engine": case_engine,
    "logprob": case_logprob,
    "moe": case_moe,
}
CASE_TITLES = {
    "calibration": "Calibration (measured on this device)",
    "loss": "1. Fused policy loss vs megatron cross-entropy + separate entropy (forward + backward to the logits)",
    "linear": "2. Fused lm-head (`fused_linear_policy_loss`) vs hidden @ W^T + fused loss",
    "actor": "3. Megatron actor train step",
    "engine": "4. Built-in HF engine generation",
    "logprob": "5. Log-prob agreement: actor vs float64 CPU reference",
    "moe": "6. Mixture of experts: expert GEMMs one by one vs grouped; the MoE actor's train step",
}


# ----------------------------------------------------------------------------- the table


def render_markdown(records: list[dict]) -> str:
    """One table per case, its columns from the records' ``table`` dicts; failures, OOMs
    and skips as rows with their reason."""
    if not records:
        return "# GPU suite\n\n(no results)\n"
    head = records[0]
    lines = [f"# GPU suite: {head.get('device_name')} ({head.get('device')}), torch {head.get('torch')}", ""]
    calib = next((r for r in records if r["case"] == "calibration"), None)
    if calib:
        lines += [
            f"megatron-core {calib.get('megatron_core')}, transformers {calib.get('transformers')}, "
            f"Python {calib.get('python')}, CUDA {calib.get('cuda')}, TE importable: {calib.get('transformer_engine')}",
            "",
        ]
    order = ["calibration", *CASES]
    for case in order + sorted({r["case"] for r in records} - {*order, "summary"}):
        rows = [r for r in records if r["case"] == case]
        if not rows:
            continue
        lines += [f"## {CASE_TITLES.get(case, case)}", ""]
        cols: list[str] = []
        for r in rows:
            for k in r.get("table") or {}:
                if k not in cols:
                    cols.append(k)
        cols = ["variant", *cols, "status"]
        lines.append("| " + " | ".join(cols) + " |")
        lines.append("|" + "---|" * len(cols))
        for r in rows:
            cells = {"variant": r.get("variant") or "-", "status": _status_cell(r), **(r.get("table") or {})}
            lines.append("| " + " | ".join(str(cells.get(c, "")) for c in cols) + " |")
        lines.append("")
    total = next((r for r in records if r["case"] == "summary"), None)
    if total:
        lines.append(f"Total {total.get('elapsed_s', 0):.0f} s; failed cases: {total.get('failed_cases') or 'none'}.")
    return "\n".join(lines) + "\n"


def _status_cell(r: dict) -> str:
    status = r.get("status", "ok")
    if status == "ok":
        return "ok"
    detail = r.get("reason") or r.get("error") or ""
    detail = str(detail).replace("|", "/").replace("\n", " ")
    return f"{status}: {detail[:160]}" if detail else status


# ----------------------------------------------------------------------------- main


def _run_case(suite: Suite, name: str, later: list[str]) -> None:
    reserve = sum(suite.sizes.reserve_s.get(c, 0) for c in later)
    share = suite.remaining() - reserve
    if share < max(1.0, suite.sizes.reserve_s.get(name, 0) / 2):
        suite.emit(name, None, "skipped", reason=f"time budget: {suite.remaining():.0f} s left, {reserve} s reserved")
        return
    suite.case_deadline = time.monotonic() + share
    t0 = time.perf_counter()
    try:
        with suite.time_limit(share):
            CASE_FNS[name](suite)
    except BaseException as exc:  # noqa: BLE001 -- one case must not lose the others' numbers
        if isinstance(exc, KeyboardInterrupt):
            raise
        tb = traceback.format_exc()
        print(tb, file=sys.stderr, flush=True)
        suite.emit(name, None, "failed", error=f"{type(exc).__name__}: {exc}"[:2000], traceback=tb[-4000:],
                   case_s=time.perf_counter() - t0)  # fmt: skip
        with contextlib.suppress(Exception):
            suite.free()
    finally:
        suite.case_deadline = None
        suite.write_table(render_markdown)


def parse_cases(values: list[str] | None) -> list[str]:
    if not values:
        return list(CASES)
    out = []
    for v in values:
        for item in v.replace(",", " ").split():
            name = CASES[int(item) - 1] if item.isdigit() and 1 <= int(item) <= len(CASES) else item
            if name not in CASES:
                raise SystemExit(f"unknown case {item!r}; choose from {', '.join(CASES)} (or 1-{len(CASES)})")
            if name not in out:
                out.append(name)
    return [c for c in CASES if c in out]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="write gpu_suite.jsonl and gpu_suite.md here")
    parser.add_argument("--cases", nargs="+", default=None, help=f"subset of {', '.join(CASES)} (or 1-{len(CASES)})")
    parser.add_argument("--tiny", action="store_true", help="toy sizes (on CPU unless --device says otherwise)")
    parser.add_argument("--device", default=None, help="cuda | cpu (default: cuda when available; cpu with --tiny)")
    parser.add_argument(
        "--budget-s", type=float, default=None, help="time budget of the whole suite (default 480; tiny 600)"
    )
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats per measurement (default 5; tiny 2)")
    parser.add_argument(
        "--backend", default=None, choices=["nccl", "gloo"], help="process group (default nccl on CUDA)"
    )
    parser.add_argument("--loss-tokens", type=int, nargs="+", default=None, help="T of the loss and linear cases")
    args = parser.parse_args(argv)
    cases = parse_cases(args.cases)

    import torch

    device = args.device or ("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("error: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    if not device.startswith("cuda") and not args.tiny:
        print(
            "error: no CUDA device; the full-size suite needs a GPU (use --tiny for toy sizes on CPU)", file=sys.stderr
        )
        return 2
    sizes = tiny_sizes() if args.tiny else gpu_sizes()
    if args.repeats:
        sizes.repeats = args.repeats
    if args.loss_tokens:
        sizes.loss_tokens = tuple(args.loss_tokens)
    if args.budget_s is None:
        args.budget_s = 600.0 if args.tiny else 480.0
    if device.startswith("cuda"):
        torch.cuda.set_device(device)

    suite = Suite(args, sizes, device)
    try:
        try:
            calibrate(suite)
        except Exception as exc:  # noqa: BLE001 -- without calibration the ratios are missing, not the cases
            print(traceback.format_exc(), file=sys.stderr, flush=True)
            suite.emit("calibration", None, "failed", error=f"{type(exc).__name__}: {exc}")
            suite.calib = {"copy_bytes_per_s": float("nan"), "gemm_flops_per_s": float("nan")}
        for i, name in enumerate(cases):
            _run_case(suite, name, cases[i + 1 :])
        heavy = sorted(m for m in ("ray", "vllm", "wandb", "transformer_engine") if m in sys.modules)
        suite.emit("summary", None, "failed" if suite.failed else "ok", elapsed_s=suite.elapsed(), cases=cases,
                   failed_cases=suite.failed, imported_heavy_modules=heavy)  # fmt: skip
        md = suite.write_table(render_markdown)
        print("\n" + md, flush=True)
    finally:
        suite.close()
    return 1 if suite.failed else 0


if __name__ == "__main__":
    sys.exit(main())
