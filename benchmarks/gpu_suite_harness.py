"""The GPU suite's machinery (``benchmarks/gpu_suite.py`` is the entry point): :class:`Suite`
(JSON-line output, timing with CUDA events, the time budget and its per-case limit, peak
memory, and the state the cases share: the world-1 process group and the random-init HF
checkpoint), :class:`CaseTimeout`, and small helpers.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import platform
import signal
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpu_suite import Sizes

SUITE = "gpu_suite"


class CaseTimeout(Exception):
    """A case ran past its share of the time budget."""


class Suite:
    """Output, timing, budget and the shared state of the cases (device, process group, model dir)."""

    def __init__(self, args, sizes: Sizes, device: str):
        import torch

        self.args, self.sizes, self.device = args, sizes, device
        self.cuda = device.startswith("cuda")
        self.start = time.monotonic()
        self.deadline = self.start + args.budget_s
        self.records: list[dict] = []
        self.failed: list[str] = []
        self.out_dir = Path(args.out) if args.out else None
        self._jsonl = None
        if self.out_dir:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self._jsonl = open(self.out_dir / "gpu_suite.jsonl", "w")  # noqa: SIM115
        self.tmp = Path(tempfile.mkdtemp(prefix="gpu_suite_"))
        self.calib: dict = {}
        self._hf_dir: Path | None = None
        self._dist = False
        self.case_deadline: float | None = None
        self.common = {
            "suite": SUITE,
            "device": device,
            "device_name": torch.cuda.get_device_name(device) if self.cuda else _cpu_name(),
            "torch": torch.__version__,
            "tiny": bool(args.tiny),
        }

    # -- output

    def emit(self, case: str, variant: str | None = None, status: str = "ok", **fields) -> dict:
        rec = {**self.common, "case": case, "variant": variant, "status": status, **fields}
        rec = _jsonable(rec)
        self.records.append(rec)
        line = json.dumps(rec)
        print(line, flush=True)
        if self._jsonl:
            self._jsonl.write(line + "\n")
            self._jsonl.flush()
        if status == "failed" and case != "summary" and case not in self.failed:
            self.failed.append(case)
        return rec

    def write_table(self, render: Callable[[list[dict]], str]) -> str:
        """Render the records with ``render`` (``gpu_suite.render_markdown``); write ``gpu_suite.md``."""
        md = render(self.records)
        if self.out_dir:
            (self.out_dir / "gpu_suite.md").write_text(md)
        return md

    # -- time

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def case_remaining(self) -> float:
        """Seconds left to the running case (its share of the budget)."""
        return (self.case_deadline or self.deadline) - time.monotonic()

    @contextlib.contextmanager
    def time_limit(self, seconds: float):
        """Raise :class:`CaseTimeout` in the main thread after ``seconds`` (SIGALRM)."""
        if seconds <= 0 or not hasattr(signal, "setitimer"):
            yield
            return

        def on_alarm(signum, frame):
            raise CaseTimeout(f"case ran past its {seconds:.0f} s share of the time budget")

        old = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize(self.device)

    def timed(self, fn, *, reset=None, warmup: int | None = None, repeats: int | None = None) -> list[float]:
        """Seconds of ``fn()`` per repeat after ``warmup`` calls (CUDA events on a GPU);
        ``reset()`` runs before each call, outside the timed region."""
        import torch

        warmup = self.sizes.warmup if warmup is None else warmup
        repeats = self.sizes.repeats if repeats is None else repeats
        for _ in range(warmup):
            if reset:
                reset()
            fn()
        self.sync()
        times = []
        for _ in range(repeats):
            if reset:
                reset()
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                self.sync()
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return times

    # -- memory

    def reset_peak(self) -> int | None:
        """Free cached blocks, reset the peak; returns the bytes allocated now (None on CPU)."""
        gc.collect()
        if not self.cuda:
            return None
        import torch

        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.memory_allocated(self.device)

    def peak_since(self, base: int | None) -> int | None:
        if base is None:
            return None
        import torch

        return torch.cuda.max_memory_allocated(self.device) - base

    def measure(self, case: str, variant: str, fn, *, reset, before=None, **fields):
        """``(times, peak)`` of ``fn`` (``timed`` after ``reset``; ``before()`` runs first,
        e.g. a one-off check); on out-of-memory, an ``oom`` line with ``fields`` and None."""
        try:
            if before is not None:
                before()
            reset()
            base = self.reset_peak()
            times = self.timed(fn, reset=reset)
            return times, self.peak_since(base)
        except Exception as exc:  # noqa: BLE001
            if not _is_oom(exc):
                raise
            reset()
            self.free()
            self.emit(case, variant, "oom", **fields, error=f"{type(exc).__name__}: {str(exc)[:300]}",
                      table={"time": "OOM"})  # fmt: skip
            return None

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            import torch

            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    # -- shared state

    def ensure_dist(self) -> None:
        """A world-1 process group (NCCL on CUDA, gloo on CPU) and megatron's parallel state (TP=1)."""
        import torch.distributed as dist

        from megatron_rl.actor.launch import init_process_group, initialize_parallel

        if not dist.is_initialized():
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
            init_process_group(backend=self.args.backend or ("nccl" if self.cuda else "gloo"))
        if not self._dist:
            initialize_parallel(tensor_model_parallel_size=1)
            self._dist = True

    def hf_model_dir(self) -> Path:
        """A random-init HF checkpoint of ``sizes.model`` (bf16 on a GPU, float32 on CPU), made once.

        Initialised so the next-token distributions look like a trained model's rather than
        uniform (HF's std-0.02 init gives logits of std ~0.2-0.5): every matrix with std
        ``1 / sqrt(fan_in)`` (each layer keeps its input's scale), the (tied) embedding with
        std ``3 / sqrt(hidden)``, so the logits have std ~3 and entropies of a few nats."""
        if self._hf_dir is not None:
            return self._hf_dir
        import torch
        from transformers import Qwen2Config, Qwen2ForCausalLM

        cfg = {k: v for k, v in self.sizes.model.items() if k != "model_type"}
        config = Qwen2Config(**cfg, architectures=["Qwen2ForCausalLM"])
        torch.manual_seed(0)
        with torch.device(self.device):
            model = Qwen2ForCausalLM(config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if param.dim() == 2 and "embed" not in name:
                    param.normal_(0.0, 1.0 / math.sqrt(param.shape[1]))
            model.get_input_embeddings().weight.normal_(0.0, 3.0 / math.sqrt(cfg["hidden_size"]))
        dtype = torch.bfloat16 if self.cuda else torch.float32
        model = model.to(dtype)
        path = self.tmp / "hf_model"
        model.save_pretrained(path)
        del model
        self.free()
        self._hf_dir = path
        return path

    def close(self) -> None:
        import shutil

        with contextlib.suppress(Exception):
            import torch.distributed as dist

            from megatron_rl.actor.launch import destroy_parallel

            if dist.is_initialized():
                destroy_parallel()
                dist.destroy_process_group()
        shutil.rmtree(self.tmp, ignore_errors=True)
        if self._jsonl:
            self._jsonl.close()


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "cpu"


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float):
        return x if math.isfinite(x) else str(x)
    if isinstance(x, (str, int, bool)) or x is None:
        return x
    if hasattr(x, "item"):
        return _jsonable(x.item())
    return str(x)


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def _is_oom(exc: BaseException) -> bool:
    import torch

    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def _dtype(name: str):
    import torch

    return {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[name]
