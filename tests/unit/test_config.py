"""The run config: sections, defaults, cross-field checks, warnings, docs and round trips."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import pytest

from megatron_rl.config.data import DataConfig, LoggingConfig
from megatron_rl.config.lib import (
    ConfigError,
    ConfigRenameWarning,
    ConfigWarning,
    field_docs,
    from_dict,
    iter_sections,
    save_resolved,
)
from megatron_rl.config.model import ModelConfig, TinyModelConfig
from megatron_rl.config.parallel import ParallelConfig
from megatron_rl.config.rollout import RolloutConfig
from megatron_rl.config.run import DOCS_PATH, RunConfig, config_reference, load_run_config
from megatron_rl.config.trainer import TrainerConfig

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "tiny_cpu.yaml"


def _load(tmp_path: Path, *overrides: str) -> RunConfig:
    """The tiny example with ``overrides``, writing (if at all) under ``tmp_path``."""
    return load_run_config(EXAMPLE, [f"trainer.output_dir={tmp_path}", *overrides])


def _load_error(tmp_path: Path, *overrides: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, *overrides)
    return info.value


@pytest.fixture(autouse=True)
def _config_warnings_are_errors():
    # A stray warning from a valid config is a bug; tests that expect one use pytest.warns.
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        yield


# --------------------------------------------------------------------------- basics


def test_example_validates(tmp_path):
    cfg = _load(tmp_path)
    assert cfg.model.tiny is not None and cfg.model.tiny.model_type == "qwen2"
    assert cfg.rollout.engine == "hf" and cfg.parallel.num_actor_ranks == 1
    assert cfg.logging.run_name == "tiny_cpu" and cfg.logging.wandb_mode == "offline"
    assert cfg.run_dir == tmp_path / "tiny_cpu"


def test_example_default_output_dir_is_runs():
    cfg = load_run_config(EXAMPLE)
    assert cfg.trainer.output_dir == "runs" and cfg.run_dir == Path("runs") / "tiny_cpu"


def test_defaults_are_a_valid_tiny_cpu_run():
    cfg = RunConfig()
    assert cfg.model.tiny == TinyModelConfig() and cfg.model.hf_config is None
    assert from_dict(RunConfig, {}) == cfg


def test_every_field_of_every_section_has_a_docstring():
    sections = dict(iter_sections(RunConfig))
    # The walk must reach the algorithm's subsections and the optional tiny model.
    assert {"model.tiny", "algorithm.ar", "algorithm.lopti", "algorithm.stapo", "trainer"} <= set(sections)
    missing = [
        f"{path}.{name}" if path else name
        for path, cls in sections.items()
        for name, doc in field_docs(cls).items()
        if not doc.strip()
    ]
    assert not missing, f"fields without a docstring: {missing}"
    for path, cls in sections.items():
        assert cls.__doc__ and cls.__doc__.strip(), f"section {path or 'top level'} has no docstring"


def test_every_section_is_keyword_only():
    for path, cls in iter_sections(RunConfig):
        assert all(f.kw_only for f in dataclasses.fields(cls)), path


def test_docs_config_md_is_up_to_date():
    assert DOCS_PATH == REPO / "docs" / "config.md"
    assert DOCS_PATH.read_text(encoding="utf-8") == config_reference(), (
        "docs/config.md is stale; regenerate it with: python -m megatron_rl.config > docs/config.md"
    )


# --------------------------------------------------------------------------- loader errors


def test_unknown_top_level_section(tmp_path):
    err = _load_error(tmp_path, "trainr.lr=1")
    assert err.path == "trainr" and "did you mean 'trainer'?" in str(err)


def test_unknown_nested_key(tmp_path):
    err = _load_error(tmp_path, "algorithm.lopti.eat=0.3")
    assert err.path == "algorithm.lopti.eat"
    assert "did you mean 'eta'?" in str(err) and "algorithm.lopti" in str(err)


def test_unknown_key_in_file_names_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  tiny: {}\nrollout:\n  num_prompt_per_step: 4\n")
    with pytest.raises(ConfigError) as info:
        load_run_config(path)
    msg = str(info.value)
    assert info.value.path == "rollout.num_prompt_per_step"
    assert "did you mean 'num_prompts_per_step'?" in msg and f"{path}, line 4" in msg


def test_wrong_type(tmp_path):
    err = _load_error(tmp_path, "trainer.num_steps=ten")
    assert err.path == "trainer.num_steps" and "expected int" in str(err) and "'ten'" in str(err)
    err = _load_error(tmp_path, "rollout.temperature=true")
    assert err.path == "rollout.temperature" and "expected float" in str(err)


def test_out_of_range_names_full_path_value_and_range(tmp_path):
    err = _load_error(tmp_path, "algorithm.ar.alpha=2")
    assert err.path == "algorithm.ar.alpha"
    assert "config field 'algorithm.ar.alpha'" in str(err)
    assert "got 2.0" in str(err) and "allowed range: [0.0, 1.0]" in str(err)


def test_literal_lists_allowed_values(tmp_path):
    err = _load_error(tmp_path, "rollout.engine=sglang")
    assert err.path == "rollout.engine" and "'sglang'" in str(err) and "'hf', 'vllm'" in str(err)
    err = _load_error(tmp_path, "algorithm.aggregation=mean")
    assert err.path == "algorithm.aggregation" and "token_mean" in str(err)


def test_plain_optimizer_has_no_fully_reshardable_format(tmp_path):
    assert _load(tmp_path).actor.use_distributed_optimizer is True
    err = _load_error(tmp_path, "actor.use_distributed_optimizer=false",
                      "actor.checkpoint_optimizer_sharding=fully_reshardable")  # fmt: skip
    assert err.path == "actor.use_distributed_optimizer" and "fully_reshardable" in str(err)


def test_bool_or_literal_fields_are_checked_in_python_too():
    with pytest.raises(ConfigError) as info:
        TrainerConfig(pack_sequences="sometimes")
    assert info.value.path == "pack_sequences" and "'auto', True, False" in str(info.value)
    assert TrainerConfig(pack_sequences=False).pack_sequences is False


def test_overrides_parse_floats_bools_null_and_lists(tmp_path):
    cfg = _load(
        tmp_path,
        "trainer.lr=1e-6",
        "algorithm.kl_coef=1e-3",
        "algorithm.lopti.enabled=true",
        "trainer.grad_clip=null",
        "data.train_files=[a.jsonl, b.jsonl]",
        "rollout.engine_args.gpu_memory_utilization=0.5",
        "rollout.tis_cap=2",
    )
    assert cfg.trainer.lr == 1e-6 and cfg.algorithm.kl_coef == 1e-3
    assert cfg.algorithm.lopti.enabled is True and cfg.trainer.grad_clip is None
    assert cfg.data.train_files == ["a.jsonl", "b.jsonl"]
    assert cfg.rollout.engine_args == {"gpu_memory_utilization": 0.5}
    assert cfg.rollout.tis_cap == 2.0


def test_switch_to_hf_config_by_override(tmp_path):
    cfg = _load(tmp_path, "model.tiny=null", "model.hf_config=/ckpt/q7b", "model.init=pretrained")
    assert cfg.model.tiny is None and cfg.model.hf_config == "/ckpt/q7b"


# --------------------------------------------------------------------------- section checks


@pytest.mark.parametrize(
    ("overrides", "path", "text"),
    [
        (["model.tiny=null"], "model.hf_config", "neither is set"),
        (["model.hf_config=/x"], "model.hf_config", "both are set"),
        (["model.init=pretrained"], "model.checkpoint", "needs a checkpoint"),
        (["model.tiny.num_attention_heads=3"], "model.tiny.num_attention_heads", "must divide hidden_size"),
        (["model.tiny.num_key_value_heads=3"], "model.tiny.num_key_value_heads", "must divide num_attention_heads"),
        (["model.dtype=float16"], "model.dtype", "'bfloat16'"),
        (["parallel.tensor_model_parallel_size=2"], "parallel.num_actor_ranks", "multiple of TP * PP * CP = 2"),
        (["parallel.num_actor_ranks=4", "parallel.data_parallel_size=2"], "parallel.data_parallel_size", "must equal"),
        (["parallel.sequence_parallel=true"], "parallel.sequence_parallel", "tensor_model_parallel_size > 1"),
        (["parallel.num_actor_ranks=0"], "parallel.num_actor_ranks", "got 0"),
        (["rollout.temperature=0"], "rollout.temperature", "[0.001, inf)"),
        (["rollout.top_p=1.5"], "rollout.top_p", "(0.0, 1.0]"),
        (["rollout.top_k=0"], "rollout.top_k", "-1 (disabled) or > 0"),
        (["rollout.tis_cap=0.5"], "rollout.tis_cap", "got 0.5"),
        (["rollout.num_samples_per_prompt=0"], "rollout.num_samples_per_prompt", "got 0"),
        (["trainer.min_lr=1"], "trainer.min_lr", "got 1.0"),
        (["trainer.grad_clip=0"], "trainer.grad_clip", "got 0.0"),
        (["trainer.num_epochs_per_step=0"], "trainer.num_epochs_per_step", "got 0"),
        (["trainer.resume="], "trainer.resume", "'auto', 'never'"),
        (["trainer.lr_schedule=step"], "trainer.lr_schedule", "'cosine'"),
        (["data.reward=a:b:c"], "data.reward", "module:function"),
        (["data.prompt_key="], "data.prompt_key", "column"),
        (["logging.run_name=a/b"], "logging.run_name", "path separators"),
        (["logging.wandb_mode=on"], "logging.wandb_mode", "'offline'"),
        (["algorithm.lopti.eta=1"], "algorithm.lopti.eta", "(0.0, 1.0)"),
        (["actor.lora.rank=0"], "actor.lora.rank", "got 0"),
        (["actor.lora.dropout=1"], "actor.lora.dropout", "got 1.0"),
        (["actor.lora.target_modules=[]"], "actor.lora.target_modules", "non-empty"),
        (["actor.lora.target_modules=[linear_qkv,linear_qkv]"], "actor.lora.target_modules", "distinct"),
        (["actor.lora.target_modules=[q_proj]"], "actor.lora.target_modules[0]", "'linear_qkv'"),
        (["actor.lora.rank=8", "model.use_te=true"], "actor.lora", "model.use_te false or null"),
        (["actor.lora.rank=8", "actor.reference_offload=true"], "actor.reference_offload", "adapters off"),
        (["actor.lora.rank=8", "model.tiny.model_type=qwen3_moe", "model.tiny.num_experts=4"], "actor.lora.target_modules",
         "experts take no adapters"),
        (["rollout.lora_sync=adapter"], "rollout.lora_sync", "actor.lora is null"),
        (["rollout.lora_sync=both"], "rollout.lora_sync", "'merged'"),
        (["rollout.engine_args={enable_lora: true}"], "rollout.engine_args.enable_lora", "lora_sync: adapter"),
        (["actor.lora.rank=8", "rollout.lora_sync=adapter", "rollout.engine_process=driver"], "rollout.lora_sync",
         "engine in the driver's process"),
    ],
)
def test_section_checks_name_the_full_path(tmp_path, overrides, path, text):
    err = _load_error(tmp_path, *overrides)
    assert err.path == path, str(err)
    assert text in str(err)


def test_parallel_sizes():
    par = ParallelConfig(num_actor_ranks=8, tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    assert par.model_parallel_size == 4 and par.resolved_data_parallel_size == 2
    assert ParallelConfig(num_actor_ranks=8, tensor_model_parallel_size=2, data_parallel_size=4).sequence_parallel is False
    ParallelConfig(num_actor_ranks=2, tensor_model_parallel_size=2, sequence_parallel=True)


def test_expert_parallel_sizes():
    """Megatron builds the expert groups over the same ranks as the dense layers: EP * ETP * PP
    must divide the ranks, whatever expert TP is (1 with TP 2: each expert whole on a rank)."""
    par = ParallelConfig(num_actor_ranks=4, expert_model_parallel_size=4)
    assert par.resolved_data_parallel_size == 4 and par.resolved_expert_tensor_parallel_size == 1
    ParallelConfig(num_actor_ranks=8, tensor_model_parallel_size=2, expert_model_parallel_size=2, sequence_parallel=True)
    with pytest.raises(ConfigError, match="ETP \\* EP \\* PP = 8") as info:
        ParallelConfig(num_actor_ranks=4, pipeline_model_parallel_size=2, expert_model_parallel_size=4)
    assert info.value.path == "expert_model_parallel_size"
    par = ParallelConfig(num_actor_ranks=4, tensor_model_parallel_size=2, expert_tensor_parallel_size=1,
                         expert_model_parallel_size=4, sequence_parallel=True)  # fmt: skip
    assert par.resolved_expert_tensor_parallel_size == 1 and par.resolved_data_parallel_size == 2
    with pytest.raises(ConfigError, match="ETP \\* EP \\* PP = 8") as info:
        ParallelConfig(num_actor_ranks=4, tensor_model_parallel_size=2, expert_tensor_parallel_size=4,
                       expert_model_parallel_size=2, sequence_parallel=True)  # fmt: skip
    assert info.value.path == "expert_model_parallel_size"
    with pytest.raises(ConfigError) as info:
        ParallelConfig(expert_model_parallel_size=0)
    assert info.value.path == "expert_model_parallel_size"


def test_section_built_in_python_is_checked_with_relative_path():
    with pytest.raises(ConfigError) as info:
        RolloutConfig(top_k=-5)
    assert info.value.path == "top_k"


def test_reward_forms():
    # data.reward is now data.task (the old YAML key is still accepted, see test_renamed_reward_key)
    assert DataConfig(task="math").task == "math"
    assert DataConfig(task="my_pkg.rewards:score").task == "my_pkg.rewards:score"


def test_resume_forms():
    assert TrainerConfig(resume="auto").resume_path is None
    assert TrainerConfig(resume="never").resume_path is None
    assert TrainerConfig(resume="runs/x/checkpoints/step_10").resume_path == Path("runs/x/checkpoints/step_10")


def test_tiny_moe_fields_on_a_dense_model_are_refused():
    with pytest.raises(ConfigError) as info:
        TinyModelConfig(num_experts_per_tok=4)
    assert info.value.path == "num_experts_per_tok"
    with pytest.raises(ConfigError) as info:
        TinyModelConfig(model_type="qwen2", num_experts=4)
    assert info.value.path == "num_experts"
    assert TinyModelConfig(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=4).num_experts_per_tok == 4


def test_tiny_to_hf_config_dict():
    hf = TinyModelConfig(num_layers=3).to_hf_config_dict()
    assert hf["num_hidden_layers"] == 3 and hf["model_type"] == "qwen2"


# --------------------------------------------------------------------------- cross-section checks


def test_an_evaluation_before_training_needs_evaluation_on(tmp_path):
    err = _load_error(tmp_path, "trainer.eval_before_train=true", "trainer.eval_every_steps=0")
    assert err.path == "trainer.eval_before_train" and "eval_every_steps" in str(err)
    assert _load(tmp_path, "trainer.eval_before_train=true", "trainer.eval_every_steps=5").trainer.eval_before_train


def test_minibatches_must_divide_samples_per_step(tmp_path):
    # the example's 8 prompts x 16 samples = 128 responses; 3 mini-batches cannot split them evenly.
    err = _load_error(tmp_path, "trainer.num_minibatches_per_step=3")
    assert err.path == "trainer.num_minibatches_per_step"
    assert "got 3" in str(err) and "= 128" in str(err)
    assert _load(tmp_path, "trainer.num_minibatches_per_step=8").trainer.num_minibatches_per_step == 8


def test_microbatch_must_hold_one_sequence(tmp_path):
    # the example's longest sequence: 16 prompt + 4 response tokens
    err = _load_error(tmp_path, "trainer.max_tokens_per_microbatch=19")
    assert err.path == "trainer.max_tokens_per_microbatch" and "= 20" in str(err)


def test_tiny_model_must_split_over_tp_and_pp(tmp_path):
    err = _load_error(tmp_path, "parallel.num_actor_ranks=8", "parallel.tensor_model_parallel_size=8")
    assert err.path == "parallel.tensor_model_parallel_size" and "model.tiny.num_attention_heads" in str(err)
    err = _load_error(tmp_path, "parallel.num_actor_ranks=4", "parallel.tensor_model_parallel_size=4")
    assert err.path == "parallel.tensor_model_parallel_size" and "model.tiny.num_key_value_heads" in str(err)
    err = _load_error(tmp_path, "parallel.num_actor_ranks=3", "parallel.pipeline_model_parallel_size=3")
    assert err.path == "parallel.pipeline_model_parallel_size"


def test_sequence_must_fit_the_tiny_model(tmp_path):
    err = _load_error(tmp_path, "rollout.max_new_tokens=1000", "trainer.max_tokens_per_microbatch=4096")
    assert err.path == "rollout.max_new_tokens" and "max_position_embeddings (64)" in str(err)


def test_hf_model_skips_architecture_checks(tmp_path):
    cfg = _load(
        tmp_path,
        "model.tiny=null",
        "model.hf_config=/ckpt/x",
        "parallel.num_actor_ranks=8",
        "parallel.tensor_model_parallel_size=8",
        "rollout.max_new_tokens=4000",
        "trainer.max_tokens_per_microbatch=8192",
    )
    assert cfg.parallel.tensor_model_parallel_size == 8


# --------------------------------------------------------------------------- warnings


@pytest.mark.parametrize(
    ("overrides", "path"),
    [
        (["algorithm.stapo.enabled=true", "algorithm.kl_coef=0.001"], "algorithm.kl_coef"),
        (["algorithm.constant_normalizer=64"], "algorithm.constant_normalizer"),
        (["trainer.min_lr=1e-5"], "trainer.min_lr"),
        (["data.eval_files=[]"], "trainer.eval_every_steps"),
        (["rollout.num_samples_per_prompt=1", "trainer.num_minibatches_per_step=1"], "rollout.num_samples_per_prompt"),
    ],
)
def test_ignored_or_unusual_settings_warn(tmp_path, overrides, path):
    with pytest.warns(ConfigWarning, match=f"config field '{path}'"):
        _load(tmp_path, *overrides)


def test_stapo_without_kl_and_dr_grpo_normalizer_do_not_warn(tmp_path):
    _load(tmp_path, "algorithm.stapo.enabled=true")
    _load(tmp_path, "algorithm.aggregation=seq_mean_token_sum_norm", "algorithm.constant_normalizer=64")


# --------------------------------------------------------------------------- round trip


def test_save_and_reload_resolved_config(tmp_path):
    cfg = _load(
        tmp_path,
        "trainer.lr=3e-6",
        "algorithm.ar.alpha=0.3",
        "algorithm.lopti.enabled=true",
        "rollout.engine_args={enforce_eager: true, max_num_seqs: 64}",
        "rollout.tis_cap=2",
    )
    path = save_resolved(cfg, cfg.run_dir)
    assert path == tmp_path / "tiny_cpu" / "config.yaml"
    assert load_run_config(path) == cfg


def test_round_trip_of_defaults_and_hf_model(tmp_path):
    for cfg in (RunConfig(), RunConfig(model=ModelConfig(hf_config="/ckpt/x"), logging=LoggingConfig(run_name="r"))):
        assert load_run_config(save_resolved(cfg, tmp_path / "d")) == cfg


def test_renamed_reward_key_selects_the_task(tmp_path):
    with pytest.warns(ConfigRenameWarning, match="'data.reward': is renamed; write 'data.task'"):
        cfg = _load(tmp_path, "data.reward=math")
    assert cfg.data.task == "math"


@pytest.mark.parametrize(
    ("overrides", "path"),
    [
        (["parallel.num_actor_ranks=2", "parallel.context_parallel_size=2"], "parallel.context_parallel_size"),
    ],
)  # fmt: skip
def test_settings_not_supported_yet_are_errors_not_no_ops(tmp_path, overrides, path):
    err = _load_error(tmp_path, *overrides)
    assert err.path == path and ("not supported yet" in str(err) or "only 'colocated'" in str(err))


def test_a_checkpoint_with_a_random_init_is_refused(tmp_path):
    """Not a warning: the run would train a random model from step 1 to the end."""
    err = _load_error(tmp_path, "model.checkpoint=/ckpt/x")
    assert err.path == "model.checkpoint" and "model.init: pretrained" in str(err)
    assert _load(tmp_path, "model.checkpoint=/ckpt/x", "model.init=pretrained").model.initial_weights == "/ckpt/x"


def test_vllm_ray_executor_is_refused_before_anything_starts(tmp_path):
    # Inside the run's placement groups vLLM's Ray executor would ask for GPU bundles the
    # actor ranks hold; the engine runs its workers as child processes.
    err = _load_error(tmp_path, "rollout.engine=vllm", "rollout.engine_args={distributed_executor_backend: ray}")
    assert err.path == "rollout.engine_args.distributed_executor_backend"
    assert _load(tmp_path, "rollout.engine=vllm", "rollout.engine_args={distributed_executor_backend: mp}")
