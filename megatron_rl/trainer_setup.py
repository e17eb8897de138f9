"""Build what the trainer drives from a :class:`~megatron_rl.config.RunConfig`.

Order matters and is the same on every run: Ray, the tokenizer and data (cheap, and
where a bad file or row must fail before any process starts), the actor ranks, the
directory the rollout engines load (config + tokenizer + initial weights), the pool,
the reward workers, the metrics sink.

Placement on CPU is colocated: actor ranks reserve no Ray CPU, engines one each, so a
2-core machine runs one actor rank and one engine side by side (time-sliced). On a
multi-node cluster ``parallel.ray_scheduling: spread`` spreads the ranks and the engines
over the nodes; the Ray node of each is recorded in ``RUN_DIR/placement.json``.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch

from megatron_rl.actor.actor import ActorConfig
from megatron_rl.actor.ray_group import ActorGroup, ActorGroupOptions
from megatron_rl.config import RunConfig
from megatron_rl.configlib import save_resolved, to_dict
from megatron_rl.data.loaders import DataError, PromptRow, load_rows
from megatron_rl.data.prompts import prompt_style_for, render_prompt
from megatron_rl.data.sampler import PromptSampler
from megatron_rl.observability import MetricsSink
from megatron_rl.rewards import RewardFunction, RewardPool, get_reward
from megatron_rl.rollout.pool import PoolOptions, RolloutPool


@dataclass
class Components:
    """Everything one run holds (see :func:`build_components`)."""

    run_dir: Path
    checkpoint_dir: Path
    resume_source: Path | None
    tokenizer: Any
    train_rows: list[PromptRow]
    eval_rows: list[PromptRow]
    sampler: PromptSampler
    actors: ActorGroup
    pool: RolloutPool
    reward: RewardFunction
    reward_pool: RewardPool
    sink: MetricsSink
    stop_token_ids: tuple[int, ...]
    pad_id: int
    config: RunConfig

    def encode_prompts(self, rows: Sequence[PromptRow]) -> tuple[list[str], list[list[int]]]:
        """Rendered prompt texts and their token ids; a prompt longer than
        ``rollout.max_prompt_tokens`` is an error naming its file and row."""
        cfg = self.config
        style = prompt_style_for(cfg.data.reward)
        texts, ids = [], []
        for row in rows:
            text = render_prompt(row.prompt, template=cfg.data.prompt_template, style=style, tokenizer=self.tokenizer)
            tokens = self.tokenizer.encode(text, add_special_tokens=False)
            if not tokens:
                raise DataError("the prompt is empty after tokenisation", file=row.file, row=row.row, field="prompt")
            if len(tokens) > cfg.rollout.max_prompt_tokens:
                raise DataError(
                    f"the prompt has {len(tokens)} tokens, more than rollout.max_prompt_tokens="
                    f"{cfg.rollout.max_prompt_tokens}",
                    file=row.file, row=row.row, field="prompt",
                )  # fmt: skip
            texts.append(text)
            ids.append(tokens)
        return texts, ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def sync_weights(self, *, version: int) -> dict[str, float]:
        """Actor weights -> every engine (buckets ``ray.put`` by actor rank 0)."""
        import time

        start = time.perf_counter()
        refs = self.actors.put_weight_buckets(int(self.config.rollout.weight_sync_bucket_mb * 2**20))
        self.pool.begin_weight_update(version)
        try:
            loads = [self.pool.load_bucket_everywhere(ref, version) for ref in refs]
            for load in loads:
                self.pool.wait_weight_loads(load)
        except BaseException:
            self.pool.abort_weight_update()
            raise
        self.pool.finish_weight_update(version, refs)
        return {"weight_sync/seconds": time.perf_counter() - start, "weight_sync/num_buckets": float(len(refs))}

    def close(self) -> None:
        self.sink.close()
        self.reward_pool.close()
        self.pool.shutdown()
        self.actors.shutdown()


def _hf_config_dict(cfg: RunConfig) -> dict[str, Any]:
    if cfg.model.tiny is not None:
        return cfg.model.tiny.to_hf_config_dict()
    path = Path(cfg.model.hf_config)
    path = path / "config.json" if path.is_dir() else path
    with open(path) as f:
        return json.load(f)


def _tokenizer(cfg: RunConfig):
    from transformers import AutoTokenizer

    source = cfg.model.tokenizer or cfg.model.hf_config or cfg.model.checkpoint
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
    config.setdefault("architectures", [_ARCHITECTURES.get(config["model_type"], "AutoModelForCausalLM")])
    config.setdefault("torch_dtype", "float32")
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(str(tmp))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp / "model.safetensors"))
    shutil.rmtree(directory, ignore_errors=True)
    os.rename(tmp, directory)


_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}


_SCHEDULING_STRATEGIES = {"default": "DEFAULT", "spread": "SPREAD"}


def _write_placement(path: Path, cfg: RunConfig, actors: ActorGroup, pool: RolloutPool) -> None:
    """Record the Ray node of every actor rank and engine (and the cluster's live nodes):
    on a multi-node run it shows where the work went."""
    nodes = {
        n["NodeID"]: {"ip": n["NodeManagerAddress"], "hostname": n["NodeManagerHostname"]}
        for n in ray.nodes()
        if n["Alive"]
    }
    placement = {
        "ray_scheduling": cfg.parallel.ray_scheduling,
        "actor_ranks": actors.node_ids(),
        "engines": pool.node_ids(),
        "nodes": nodes,
    }
    path.write_text(json.dumps(placement, indent=2) + "\n")


def _resume_source(cfg: RunConfig, checkpoint_dir: Path) -> Path | None:
    mode = cfg.trainer.resume
    if mode == "never":
        return None
    if mode == "auto":
        return checkpoint_dir if (checkpoint_dir / "latest").exists() else None
    path = Path(mode)
    if not path.exists():
        raise FileNotFoundError(f"config field 'trainer.resume': checkpoint {mode!r} does not exist")
    return path


def build_components(cfg: RunConfig) -> Components:
    run_dir = cfg.run_dir
    checkpoint_dir = run_dir / "checkpoints"
    resume_source = _resume_source(cfg, checkpoint_dir)
    if resume_source is None and cfg.trainer.resume == "never" and (checkpoint_dir / "latest").exists():
        raise FileExistsError(
            f"{run_dir} already holds checkpoints and trainer.resume is 'never': choose another "
            "logging.run_name or trainer.output_dir, or resume"
        )

    # Cheap and strict first: a bad data file fails before any process starts.
    tokenizer = _tokenizer(cfg)
    keys = {"prompt_key": cfg.data.prompt_key, "ground_truth_key": cfg.data.ground_truth_key}
    train_rows = load_rows(cfg.data.train_files, **keys)
    eval_rows = load_rows(cfg.data.eval_files, **keys) if cfg.data.eval_files else []
    reward = get_reward(cfg.data.reward)
    hf_config = _hf_config_dict(cfg)
    if len(tokenizer) > hf_config["vocab_size"]:
        raise ValueError(
            f"config field 'model': the tokenizer has {len(tokenizer)} tokens but the model's "
            f"vocab_size is {hf_config['vocab_size']}"
        )

    run_dir.mkdir(parents=True, exist_ok=True)
    save_resolved(cfg, run_dir)
    if not ray.is_initialized():
        ray.init(
            address=os.environ.get("RAY_ADDRESS") or None,
            include_dashboard=False,
            log_to_driver=True,
            configure_logging=False,
        )

    cuda = torch.cuda.is_available()
    strategy = _SCHEDULING_STRATEGIES[cfg.parallel.ray_scheduling]
    actor_config = ActorConfig.from_run_config(cfg)
    actors = ActorGroup(
        actor_config,
        ActorGroupOptions(
            num_ranks=cfg.parallel.num_actor_ranks,
            num_gpus_per_rank=1.0 if cuda else 0.0,
            with_reference=cfg.algorithm.needs_ref_logp,
            scheduling_strategy=strategy,
        ),
    )
    if cfg.model.init == "pretrained":
        source = cfg.model.checkpoint or cfg.model.hf_config
        if (Path(source) / "config.json").exists() and any(Path(source).glob("*.safetensors")):
            actors.load_hf_weights(source)
        else:
            actors.load_checkpoint(source)
    engine_dir = run_dir / "engine_init"
    _write_engine_model_dir(engine_dir, hf_config, tokenizer, actors.hf_state_dict())

    pool = RolloutPool.from_config(
        cfg.rollout,
        str(engine_dir),
        options=PoolOptions(
            num_cpus_per_engine=0.0 if cuda else 1.0, num_gpus_per_engine=0.0, scheduling_strategy=strategy
        ),
    )
    _write_placement(run_dir / "placement.json", cfg, actors, pool)
    reward_pool = RewardPool(reward, num_workers=cfg.data.num_reward_workers, timeout_s=cfg.data.reward_timeout_s)
    sink = MetricsSink(
        run_dir,
        wandb_mode=cfg.logging.wandb_mode,
        project=cfg.logging.wandb_project,
        run_name=cfg.logging.run_name,
        config=to_dict(cfg),
    )
    stops = tuple(t for t in {tokenizer.eos_token_id} if t is not None)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (stops[0] if stops else 0)
    return Components(
        run_dir=run_dir,
        checkpoint_dir=checkpoint_dir,
        resume_source=resume_source,
        tokenizer=tokenizer,
        train_rows=train_rows,
        eval_rows=eval_rows,
        sampler=PromptSampler(len(train_rows), seed=cfg.trainer.seed, shuffle=cfg.data.shuffle),
        actors=actors,
        pool=pool,
        reward=reward,
        reward_pool=reward_pool,
        sink=sink,
        stop_token_ids=stops,
        pad_id=int(pad),
        config=cfg,
    )
