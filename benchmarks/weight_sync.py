"""The run's weight sync on CPU: seconds per GB, object store vs collective (gloo), 1 and 2
engines, and the host memory a sync costs as a multiple of the largest bucket.

Everything is the run's own path (``weight_sync.WeightSync``): a Megatron actor (TP 1, one
Ray rank, random init) gathers HF-named tensors bucket by bucket and

- ``object_store``: rank 0 ``ray.put``s each bucket (at most ``max_inflight_buckets``
  ahead), every engine maps and loads it;
- ``collective``: rank 0 broadcasts each bucket over a gloo group to every engine's
  receiver (the control flow of vLLM's NCCL backend on GPUs).

The engines are built-in (HF) engines in Ray actors, 1 CPU each, started from other
weights. Model (default): Qwen2 shape, hidden 1024, 8 layers, FFN 2816, 16/4 heads, vocab
32000, untied, float32: 0.62 GB of payload. Per (transport, engines): one warm-up sync,
then the median of ``--repeats``; the peak growth of the private memory (USS) of the
driver and of actor rank 0 during the measured syncs, divided by the largest bucket (the
bucket size, or the largest tensor when that is bigger). The object store's buckets live
in Ray's shared-memory arena (bounded by ``max_inflight_buckets``), not in USS.

One JSON line per case; then a ``projection_14b_tp4`` line: the measured object-store and
collective seconds per GB applied to a 14B model's bf16 payload (29.5 GB: Qwen2.5-14B).
That is a CPU/gloo figure, not a GPU one (NCCL between H100s was never measured here).

    python benchmarks/weight_sync.py
    python benchmarks/weight_sync.py --layers 4 --engines 1 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import threading
import time

import psutil

QWEN25_14B_BF16_BYTES = 14.77e9 * 2  # parameters x 2 bytes


def save_model(directory: str, args, seed: int) -> dict:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = dict(
        model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=args.hidden,
        intermediate_size=args.ffn, num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=4,
        vocab_size=args.vocab, max_position_embeddings=512, tie_word_embeddings=False, torch_dtype="float32",
    )  # fmt: skip
    torch.manual_seed(seed)
    Qwen2ForCausalLM(Qwen2Config(**{k: v for k, v in config.items() if k != "architectures"})).save_pretrained(
        directory
    )
    return config


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class PeakMemory:
    """Samples the private memory (USS: pages no other process shares, so the object
    store's shared-memory arena, which stays mapped once touched, is not counted) of some
    processes every ~10 ms; ``growth()`` is peak minus start, per process."""

    def __init__(self, pids: dict[str, int]):
        self.procs = {k: psutil.Process(p) for k, p in pids.items()}
        self.start = {k: p.memory_full_info().uss for k, p in self.procs.items()}
        self.peak = dict(self.start)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for k, p in self.procs.items():
                self.peak[k] = max(self.peak[k], p.memory_full_info().uss)
            time.sleep(0.01)

    def growth(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        return {k: self.peak[k] - self.start[k] for k in self.procs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--bucket-mb", type=int, default=128)
    parser.add_argument("--engines", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import ray

    from megatron_rl.actor.group import ActorGroup
    from megatron_rl.actor.spec import ActorSpec
    from megatron_rl.cluster.placement import GroupPlacement
    from megatron_rl.config.parallel import ParallelConfig
    from megatron_rl.config.rollout import RolloutConfig
    from megatron_rl.rollout import RolloutPool
    from megatron_rl.weight_sync.sync import WeightSync

    common = {"benchmark": "weight_sync", "cpu": cpu_name(), "cores": os.cpu_count()}
    per_gb: dict[str, float] = {}
    ray.init(num_cpus=max(args.engines) + 1, include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as tmp:
        config = save_model(os.path.join(tmp, "engine"), args, seed=1)
        actors = ActorGroup(ActorSpec(architecture=config, parallel=ParallelConfig()), GroupPlacement.uniform(1))
        rank0 = ray.get(actors.workers[0].__ray_call__.remote(lambda self: os.getpid()))
        try:
            for engines in args.engines:
                for transport, backend in (("object_store", "object_store"), ("collective", "gloo")):
                    rollout = RolloutConfig(num_engines=engines, weight_transport=transport,
                                            weight_sync_bucket_mb=args.bucket_mb)  # fmt: skip
                    pool = RolloutPool(rollout, os.path.join(tmp, "engine"), weight_backend=backend,
                                       placement=GroupPlacement.uniform(engines, num_cpus=1))  # fmt: skip
                    sync = WeightSync(actors, pool, rollout, transport=transport, backend=backend)
                    try:
                        sync.run(1)  # warm-up: group set-up, first allocations
                        payload = sum(m.num_bytes for m in sync.metas)
                        largest = max(args.bucket_mb << 20, max(m.num_bytes for m in sync.metas))
                        times = []
                        memory = PeakMemory({"driver": os.getpid(), "rank0": rank0})
                        for version in range(2, 2 + args.repeats):
                            start = time.perf_counter()
                            sync.run(version)
                            times.append(time.perf_counter() - start)
                        growth = memory.growth()
                    finally:
                        sync.close()
                        pool.shutdown()
                    seconds = statistics.median(times)
                    per_gb[f"{transport}/{engines}"] = seconds / (payload / 1e9)
                    print(json.dumps({
                        **common, "case": transport, "engines": engines, "bucket_mb": args.bucket_mb,
                        "payload_bytes": payload, "num_tensors": len(sync.metas), "seconds": round(seconds, 3),
                        "seconds_per_gb": round(seconds / (payload / 1e9), 3),
                        "largest_bucket_bytes": largest,
                        "peak_private_growth_driver_buckets": round(growth["driver"] / largest, 2),
                        "peak_private_growth_rank0_buckets": round(growth["rank0"] / largest, 2),
                        "loadavg_1min": round(os.getloadavg()[0], 2),
                    }), flush=True)  # fmt: skip
        finally:
            actors.shutdown()
            ray.shutdown()
    print(json.dumps({
        **common, "case": "projection_14b_tp4", "payload_bytes": QWEN25_14B_BF16_BYTES,
        **{f"seconds_{k.replace('/', '_engines')}": round(v * QWEN25_14B_BF16_BYTES / 1e9, 1) for k, v in per_gb.items()},
        "note": "CPU gloo/object-store rates applied to 14B bf16; not a GPU (NCCL) measurement",
    }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
