"""Build a run's components from its :class:`~megatron_rl.config.RunConfig`.

The only module that maps the whole run config onto components: each component gets
the sections it needs, by reference. Order matters and is the same on every run:

1. cheap and strict first, so a bad file, row or name fails before any process
   starts: the tokenizer, the task, the data rows (rendered and tokenised on demand by
   a :class:`~megatron_rl.data.source.PromptSource`), the architecture;
2. Ray, then the actor ranks (:class:`~megatron_rl.actor.ray_group.ActorGroup`, built
   from an :class:`~megatron_rl.actor.spec.ActorSpec`) with their initial weights;
3. the directory the rollout engines load (config + tokenizer + the actor's initial
   weights), then the engine pool;
4. the reward workers and the metrics sink.

Placement (where each actor rank and engine runs) comes from :mod:`megatron_rl.placement`.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch

from megatron_rl.actor.ray_group import ActorGroup
from megatron_rl.actor.spec import ActorSpec
from megatron_rl.config import RunConfig
from megatron_rl.configlib import save_resolved, to_dict
from megatron_rl.data.loaders import load_rows
from megatron_rl.data.prompts import PromptEncoder
from megatron_rl.data.source import PromptSource
from megatron_rl.models import adapter_for_config
from megatron_rl.observability import MetricsSink
from megatron_rl.placement import actor_placement, engine_placement, write_placement
from megatron_rl.rewards import RewardPool
from megatron_rl.rollout.pool import RolloutPool
from megatron_rl.tasks import Task, get_task

__all__ = ["Run", "actor_spec", "build_run", "resume_source"]


@dataclass
class Run:
    """The components of one run, built by :func:`build_run` and driven by the trainer."""

    config: RunConfig
    """The resolved run config (saved as ``RUN_DIR/config.yaml``)."""
    checkpoint_dir: Path
    """``RUN_DIR/checkpoints``."""
    resume_from: Path | None
    """The checkpoint (or checkpoint directory with ``latest``) to resume from, if any."""
    task: Task
    """Prompt style, reward and eval grouping."""
    prompts: PromptSource
    """Training prompts in a resumable order, eval prompts, tokenisation."""
    actors: ActorGroup
    """The Megatron actor's ranks."""
    pool: RolloutPool
    """The rollout engines."""
    rewards: RewardPool
    """Time-limited workers scoring responses with the task's reward."""
    sink: MetricsSink
    """Metrics to ``RUN_DIR/metrics.jsonl`` (and wandb)."""

    def close(self) -> None:
        """Stop the engines, actor ranks and reward workers; flush the metrics."""
        self.sink.close()
        self.rewards.close()
        self.pool.shutdown()
        self.actors.shutdown()


def hf_config_dict(config: RunConfig) -> dict[str, Any]:
    """The architecture as a HF ``config.json`` dict (the tiny model's, or read from disk)."""
    if config.model.tiny is not None:
        return config.model.tiny.to_hf_config_dict()
    path = Path(config.model.hf_config)
    path = path / "config.json" if path.is_dir() else path
    with open(path) as f:
        return json.load(f)


def actor_spec(config: RunConfig) -> ActorSpec:
    """What every actor rank is built from: the architecture and the sections it reads."""
    model = config.model
    return ActorSpec(
        architecture=model.hf_config if model.hf_config is not None else model.tiny.to_hf_config_dict(),
        model=model,
        parallel=config.parallel,
        trainer=config.trainer,
        actor=config.actor,
        algorithm=config.algorithm,
        rollout=config.rollout,
    )


def resume_source(config: RunConfig, checkpoint_dir: Path) -> Path | None:
    """The checkpoint ``trainer.resume`` names: ``auto`` -> the run's latest (if any)."""
    mode = config.trainer.resume
    if mode == "never":
        if (checkpoint_dir / "latest").exists():
            raise FileExistsError(
                f"{checkpoint_dir.parent} already holds checkpoints and trainer.resume is 'never': choose another "
                "logging.run_name or trainer.output_dir, or resume"
            )
        return None
    if mode == "auto":
        return checkpoint_dir if (checkpoint_dir / "latest").exists() else None
    path = config.trainer.resume_path
    if not path.exists():
        raise FileNotFoundError(f"config field 'trainer.resume': checkpoint {mode!r} does not exist")
    return path


def _tokenizer(config: RunConfig):
    from transformers import AutoTokenizer

    source = config.model.tokenizer or config.model.hf_config or config.model.checkpoint
    if source is None:
        raise ValueError("config field 'model.tokenizer': a tokenizer directory is needed (the tiny model has none)")
    path = Path(source)
    if path.is_file():
        path = path.parent
    if not path.exists():
        raise FileNotFoundError(f"config field 'model.tokenizer': {str(path)!r} does not exist")
    return AutoTokenizer.from_pretrained(str(path))


def _write_engine_model_dir(directory: Path, hf_config: dict[str, Any], tokenizer, weights: dict[str, torch.Tensor]):
    """config.json + tokenizer + safetensors of the actor's initial weights, for the engines."""
    from safetensors.torch import save_file

    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = dict(hf_config)
    config.setdefault("architectures", [adapter_for_config(config).architecture or "AutoModelForCausalLM"])
    config.setdefault("torch_dtype", "float32")
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(str(tmp))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp / "model.safetensors"))
    shutil.rmtree(directory, ignore_errors=True)
    os.rename(tmp, directory)


def build_run(config: RunConfig) -> Run:
    """Every component of the run, in the order the module docstring gives."""
    run_dir = config.run_dir
    checkpoint_dir = run_dir / "checkpoints"
    resume_from = resume_source(config, checkpoint_dir)

    # Cheap and strict first: a bad data file fails before any process starts.
    tokenizer = _tokenizer(config)
    task = get_task(config.data.task)
    keys = {"prompt_key": config.data.prompt_key, "ground_truth_key": config.data.ground_truth_key}
    train_rows = load_rows(config.data.train_files, **keys)
    eval_rows = load_rows(config.data.eval_files, **keys) if config.data.eval_files else []
    hf_config = hf_config_dict(config)
    if len(tokenizer) > hf_config["vocab_size"]:
        raise ValueError(
            f"config field 'model': the tokenizer has {len(tokenizer)} tokens but the model's "
            f"vocab_size is {hf_config['vocab_size']}"
        )
    encoder = PromptEncoder(
        tokenizer,
        template=config.data.prompt_template,
        style=task.prompt_style,
        max_prompt_tokens=config.rollout.max_prompt_tokens,
    )
    prompts = PromptSource(
        train_rows, eval_rows, encoder=encoder, seed=config.trainer.seed, shuffle=config.data.shuffle
    )  # fmt: skip

    run_dir.mkdir(parents=True, exist_ok=True)
    save_resolved(config, run_dir)
    if not ray.is_initialized():
        ray.init(
            address=os.environ.get("RAY_ADDRESS") or None,
            include_dashboard=False,
            log_to_driver=True,
            configure_logging=False,
        )
    cuda = torch.cuda.is_available()
    actors = ActorGroup(actor_spec(config), actor_placement(config.parallel, cuda=cuda))
    initial = config.model.initial_weights
    if initial is not None:
        if (Path(initial) / "config.json").exists() and any(Path(initial).glob("*.safetensors")):
            actors.load_hf_weights(initial)
        else:
            actors.load_checkpoint(initial)
    engine_dir = run_dir / "engine_init"
    _write_engine_model_dir(engine_dir, hf_config, tokenizer, actors.hf_state_dict())
    pool = RolloutPool(
        config.rollout, str(engine_dir), placement=engine_placement(config.rollout, config.parallel, cuda=cuda)
    )
    write_placement(
        run_dir / "placement.json",
        ray_scheduling=config.parallel.ray_scheduling,
        actor_nodes=actors.node_ids(),
        engine_nodes=pool.node_ids(),
    )
    rewards = RewardPool(task.reward, num_workers=config.data.num_reward_workers, timeout_s=config.data.reward_timeout_s)
    sink = MetricsSink(
        run_dir,
        wandb_mode=config.logging.wandb_mode,
        project=config.logging.wandb_project,
        run_name=config.logging.run_name,
        config=to_dict(config),
    )
    return Run(
        config=config,
        checkpoint_dir=checkpoint_dir,
        resume_from=resume_from,
        task=task,
        prompts=prompts,
        actors=actors,
        pool=pool,
        rewards=rewards,
        sink=sink,
    )
