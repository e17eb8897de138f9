"""Fixtures for end-to-end runs of the trainer on the tiny CPU demo."""

from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny_cpu.yaml"
MOE_EXAMPLE = ROOT / "examples" / "tiny_cpu_moe.yaml"
LORA_EXAMPLE = ROOT / "examples" / "tiny_cpu_lora.yaml"
SFT_EXAMPLE = ROOT / "examples" / "tiny_cpu_sft.yaml"
TOY = ROOT / "examples" / "data" / "toy"


def tiny_overrides(output_dir, *extra: str) -> list[str]:
    """Overrides that make the example run anywhere (absolute data paths, a temp run dir)."""
    return [
        f"trainer.output_dir={output_dir}",
        f"data.train_files=[{TOY / 'train.jsonl'}]",
        f"data.eval_files=[{TOY / 'test.jsonl'}]",
        f"model.tokenizer={TOY / 'tokenizer'}",
        "logging.wandb_mode=disabled",
        *extra,
    ]


def tiny_config(output_dir, *extra: str, example: Path = EXAMPLE, command: str = "train"):
    """The example's config (an RL run's, or an SFT run's for ``command="sft"``) with
    :func:`tiny_overrides`."""
    from megatron_rl.config.run import load_run_config
    from megatron_rl.config.sft import load_sft_config

    load = load_sft_config if command == "sft" else load_run_config
    return load(example, tiny_overrides(output_dir, *extra))


BASELINE = ("trainer.num_steps=3", "trainer.eval_every_steps=0", "trainer.save_every_steps=0",
            "trainer.save_final=false")  # fmt: skip
"""The 3-step run several modules compare against (default settings: colocated, fused lm-head).
Runs whose checkpoints no test reads set ``save_final=false``: a save spawns megatron's
checkpoint writer process in the actor (~2 CPU-s a run)."""
WARM_BASE = ("trainer.num_steps=100", "trainer.seed=1", "trainer.eval_every_steps=0", "trainer.save_every_steps=100",
             "logging.token_diagnostics=false")  # fmt: skip
"""The demo's first 100 steps, the base LoRA_EXAMPLE warms up from (its ``step_000100``, as
the example's comment tells a user to make it)."""
ASYNC = ("rollout.placement=disaggregated", "rollout.max_staleness=1", "rollout.tis_cap=2.0")
"""One-step-off rollout (generation ahead of the update)."""
ASYNC_STEPS = ("trainer.num_steps=5", "trainer.eval_every_steps=3", "trainer.save_every_steps=2")
"""The steps of the one-step-off comparisons (test_async_rollout.py, test_engine_in_driver.py)."""
KL_RUN = ("trainer.num_steps=3", "trainer.eval_every_steps=0", "trainer.save_every_steps=2", "trainer.save_final=false",
          "algorithm.kl_coef=0.01")
"""A 3-step run with a KL term (so a reference policy) and a checkpoint mid-way."""


def train_in_process(config) -> list[dict]:
    """Train ``config`` in this process (the caller's Ray cluster); its logged metrics, in
    step order."""
    from megatron_rl.loop.pipeline import make_trainer
    from megatron_rl.observability import read_metrics
    from tests.helpers.warm_workers import warm_workers

    trainer = make_trainer(config, warm=warm_workers())
    try:
        trainer.run()
    finally:
        trainer.close()
    return read_metrics(config.run_dir)


def train_sft_in_process(config) -> list[dict]:
    """The SFT run ``config`` trained in this process (its own actor ranks, on the caller's
    Ray cluster); its logged metrics, in step order."""
    from megatron_rl.loop.sft import SFTTrainer
    from megatron_rl.observability import read_metrics

    trainer = SFTTrainer(config)
    try:
        trainer.run()
    finally:
        trainer.close()
    return read_metrics(config.run_dir)


@dataclass
class TinyRun:
    """What :func:`tiny_run` keeps of a finished in-process run."""

    rows: dict[int, dict]
    """The logged metrics by step."""
    last: dict
    """The metrics ``Trainer.run`` returned."""
    events: list[str]
    """The engine's and the actor's transitions, merged by time (``engine:generate``, ...)."""
    engine_pid: int
    """The first engine's process."""
    transport: str
    """The weight transport the run resolved (``WeightSync.transport``)."""
    run_dir: Path


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """``tiny_run(*overrides, example=EXAMPLE)``: the tiny demo (or ``example``) trained in
    this process with ``overrides``, once per session and resolved config: modules that
    compare against the same run share it."""
    import json

    import ray

    from megatron_rl.config.lib import to_dict
    from megatron_rl.loop.pipeline import make_trainer
    from megatron_rl.observability import read_metrics
    from tests.helpers.warm_workers import warm_workers
    from tests.ray_cluster import shared_ray

    root, cache = tmp_path_factory.mktemp("tiny_runs"), {}

    def run(*overrides: str, example: Path = EXAMPLE) -> TinyRun:
        config = tiny_config(root / f"run{len(cache)}", *overrides, example=example)
        settings = to_dict(config)
        settings["trainer"].pop("output_dir")
        key = json.dumps(settings, sort_keys=True, default=str)
        if key not in cache:
            shared_ray("e2e")
            trainer = make_trainer(config, warm=warm_workers())
            try:
                engine_pid = trainer.parts.pool.health()[0]["pid"]
                transport = trainer.parts.weight_sync.transport
                last = trainer.run()
                engine = ray.get(trainer.parts.pool.actors[0].get_transitions.remote()) \
                    if hasattr(trainer.parts.pool, "actors") else []  # fmt: skip
                actor = trainer.parts.actors.transitions()
            finally:
                trainer.close()
            merged = sorted([(s, f"engine:{e}") for s, e in engine] + [(s, f"actor:{e}") for s, e in actor])
            rows = {r["step"]: r for r in read_metrics(trainer.config.run_dir)}
            cache[key] = TinyRun(rows=rows, last=last, events=[e for _, e in merged], engine_pid=engine_pid,
                                 transport=transport, run_dir=trainer.config.run_dir)  # fmt: skip
        return cache[key]

    return run


@pytest.fixture(scope="module")
def ray_session():
    """The e2e tier's shared local Ray cluster (tests/ray_cluster.py)."""
    from tests.ray_cluster import shared_ray

    shared_ray("e2e")


def train_cli(out_dir, *extra, log: Path | None = None, example: Path = EXAMPLE, command: str = "train"):
    """``megatron-rl train`` (or ``command``: ``sft``) of the tiny demo (or ``example``) in a
    new process group (so a kill reaches every process); its output to ``log`` when given (a
    pipe nobody reads can fill and stall it)."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "megatron_rl", command, str(example), *tiny_overrides(out_dir, *extra)]
    out = subprocess.PIPE if log is None else open(log, "w")  # noqa: SIM115  (closed with the process)
    return subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip


@dataclass
class KilledAndResumed:
    """What :func:`kill9_and_resume` leaves: both runs' metrics by step, and the checkpoint
    ``latest`` named right after the kill."""

    uninterrupted: dict[int, dict]
    resumed: dict[int, dict]
    run_dir: Path
    latest_after_kill: str


def kill9_and_resume(
    tmp_path, *args: str, checkpointed: int, logged: int, example: Path = EXAMPLE, command: str = "train"
) -> KilledAndResumed:
    """Run the demo (or ``example``, with ``megatron-rl command``) with ``args`` in a CLI
    process (``tmp_path/b``); SIGKILL its process group once checkpoint
    ``step_<checkpointed>`` exists and step ``logged`` is in ``metrics.jsonl``, rerun it
    there to the end (it resumes), and compare with the same settings run uninterrupted
    (``tmp_path/a``). Only the killed run is a CLI process. The uninterrupted run and the
    rerun are trained in this process on the e2e tier's cluster (:func:`train_in_process`,
    :func:`train_sft_in_process`), one after the other: resuming is the trainer's
    (``build_run`` takes the run directory's lock and reads its checkpoints), and the rerun's
    actor ranks and engine are the uninterrupted run's, kept (``tests/helpers/warm_workers``),
    so a state the resume failed to restore shows as that run's numbers. A rerun through the
    CLI after a kill -9 is tests/e2e/test_reliability.py's and tests/vllm/test_vllm_trainer.py's."""
    import time

    from megatron_rl.observability import read_metrics
    from tests.helpers.jobs import kill_group
    from tests.ray_cluster import shared_ray

    tmp_path.mkdir(parents=True, exist_ok=True)
    victim = train_cli(tmp_path / "b", *args, log=tmp_path / "b.log", example=example, command=command)
    ref_config = tiny_config(tmp_path / "a", *args, example=example, command=command)
    rerun_config = tiny_config(tmp_path / "b", *args, example=example, command=command)
    run_dir = rerun_config.run_dir
    try:
        deadline = time.time() + 600
        while time.time() < deadline:
            if (run_dir / "checkpoints" / f"step_{checkpointed:06d}").is_dir() and (run_dir / "metrics.jsonl").exists():
                if any(r["step"] >= logged for r in read_metrics(run_dir)):
                    break
            if victim.poll() is not None:
                pytest.fail("the run finished before it could be killed:\n" + (tmp_path / "b.log").read_text())
            time.sleep(0.05)
        kill_group(victim)
        victim.wait()
        latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    finally:
        kill_group(victim)

    shared_ray("e2e")
    train = train_sft_in_process if command == "sft" else train_in_process
    uninterrupted, resumed = train(ref_config), train(rerun_config)
    return KilledAndResumed(
        uninterrupted={r["step"]: r for r in uninterrupted},
        resumed={r["step"]: r for r in resumed},
        run_dir=run_dir,
        latest_after_kill=latest,
    )


def assert_adapters_only(checkpoint: Path, base: Path) -> None:
    """``checkpoint`` is an adapter-only LoRA checkpoint over ``base``: it names that base
    (absolute path and fingerprint) and every model tensor it stores is an adapter's."""
    from torch.distributed.checkpoint import FileSystemReader

    from megatron_rl.storage.checkpoints import base_weights_of, weights_fingerprint

    assert base_weights_of(checkpoint) == {"path": str(base.absolute()), "fingerprint": weights_fingerprint(base)}
    keys = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith(("embedding.", "decoder.", "output_layer."))]
    assert model_keys and all(k.endswith((".lora_a", ".lora_b")) for k in model_keys), model_keys
