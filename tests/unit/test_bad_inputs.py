"""Every bad input of issue 17, table-driven: ``megatron-rl train`` refuses it before anything
starts, with exit code 2, an ``error:`` line naming the field, file or row, and no traceback.

The table runs in-process with ``--dry-run`` (the dry run and the real run share one
pre-flight, ``megatron_rl/loop/preflight.py``; an uncaught exception would fail the test as a
traceback would), a few cases run as real ``python -m megatron_rl train`` subprocesses,
and ``tests/e2e/test_reliability.py`` shows a real run stopping before Ray starts.
Checkpoint cases use stand-in checkpoints (``tests/helpers/checkpoints.py``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from megatron_rl import cli
from tests.helpers.checkpoints import make_checkpoint, tiny_scheduler

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "tiny_cpu.yaml"
TOY = REPO / "examples" / "data" / "toy"
TOY_PATHS = [
    f"model.tokenizer={TOY / 'tokenizer'}",
    f"data.train_files=[{TOY / 'train.jsonl'}]",
    f"data.eval_files=[{TOY / 'test.jsonl'}]",
]
ROW = {"prompt": "copy 1 2 3 =", "ground_truth": "1 2 3"}
LONG_PROMPT = "copy " + " ".join("7" * 40) + " ="  # 42 tokens; the example allows 16


def _jsonl(tmp: Path, name: str, rows: list, *, raw: dict[int, bytes] | None = None) -> Path:
    """Rows as JSON lines in ``tmp/name``; ``raw`` replaces given (1-based) lines by raw bytes."""
    lines = [json.dumps(r).encode() for r in rows]
    for row, data in (raw or {}).items():
        lines[row - 1] = data
    path = tmp / name
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


def _train_file(tmp: Path, name: str, rows: list, **raw) -> list[str]:
    return [f"data.train_files=[{_jsonl(tmp, name, rows, **raw)}]"]


def _hf_model(tmp: Path, **config) -> list[str]:
    """``model.hf_config`` pointing at a small Qwen2 config.json (6 heads) with ``config`` changes."""
    model = tmp / "model"
    model.mkdir(exist_ok=True)
    base = {
        "model_type": "qwen2", "hidden_size": 96, "num_hidden_layers": 2, "num_attention_heads": 6,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 32, "max_position_embeddings": 64,
    }  # fmt: skip
    (model / "config.json").write_text(json.dumps({k: v for k, v in {**base, **config}.items() if v is not None}))
    return ["model.tiny=null", f"model.hf_config={model}"]


def _alias_bomb(tmp: Path) -> list[str]:
    """The example with nested anchors in ``rollout.engine_args``: ~700 bytes that expand to 1e9 values."""
    anchors = ["    a0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    anchors += [f"    a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 9)]
    path = tmp / "bomb.yaml"
    path.write_text(
        EXAMPLE.read_text().replace("rollout:\n", "rollout:\n  engine_args:\n" + "\n".join(anchors) + "\n", 1)
    )
    return [f"CONFIG={path}"]


def _resume(tmp: Path, *overrides: str, broken: tuple[str, ...] = (), **record) -> list[str]:
    """Stand-in checkpoints step_1 and step_2 in the run directory (``broken`` ones truncated)."""
    folder = tmp / "out" / "tiny_cpu" / "checkpoints"
    for step in (1, 2):
        make_checkpoint(folder, step, **record)
    for name in broken:
        os.truncate(folder / name / "__0_0.distcp", 7)
    return list(overrides)


Setup = Callable[[Path], list[str]]
LATIN1_ROW = b'{"prompt": "caf\xe9 1 2 =", "ground_truth": "1 2"}'
# (id, setup -> extra overrides (``CONFIG=path`` replaces the config file), what stderr must name)
CASES: list[tuple[str, Setup, tuple[str, ...]]] = [
    # ---- config values: non-finite, absurd, beyond the limits
    ("lr_inf", lambda t: ["trainer.lr=.inf"], ("trainer.lr", "finite")),
    ("lr_nan", lambda t: ["trainer.lr=.nan"], ("trainer.lr", "finite")),
    ("adam_eps_inf", lambda t: ["trainer.adam_eps=.inf"], ("trainer.adam_eps", "finite")),
    ("weight_decay_inf", lambda t: ["trainer.weight_decay=.inf"], ("trainer.weight_decay", "finite")),
    ("temperature_inf", lambda t: ["rollout.temperature=.inf"], ("rollout.temperature", "finite")),
    ("temperature_1e-300", lambda t: ["rollout.temperature=1e-300"], ("rollout.temperature", "[0.001")),
    ("rope_theta_inf", lambda t: ["model.tiny.rope_theta=.inf"], ("model.tiny.rope_theta", "finite")),
    ("rms_norm_eps_inf", lambda t: ["model.tiny.rms_norm_eps=.inf"], ("model.tiny.rms_norm_eps", "finite")),
    ("eps_high_inf", lambda t: ["algorithm.eps_high=.inf"], ("algorithm.eps_high", "finite")),
    ("entropy_coef_inf", lambda t: ["algorithm.entropy_coef=.inf"], ("algorithm.entropy_coef", "finite")),
    ("reward_timeout_inf", lambda t: ["data.reward_timeout_s=.inf"], ("data.reward_timeout_s", "finite")),
    ("reward_timeout_3e6", lambda t: ["data.reward_timeout_s=3e6"], ("data.reward_timeout_s", "86400")),
    ("reward_workers_1e5", lambda t: ["data.num_reward_workers=100000"], ("data.num_reward_workers", "512")),
    ("engines_1e5", lambda t: ["rollout.num_engines=100000"], ("rollout.num_engines", "4096")),
    ("seed_65_bits", lambda t: [f"trainer.seed={2**65}"], ("trainer.seed", str(2**63 - 1))),
    ("seed_negative", lambda t: ["trainer.seed=-1"], ("trainer.seed",)),
    ("max_new_tokens_1e8", lambda t: ["rollout.max_new_tokens=100000000"], ("rollout.max_new_tokens",)),
    ("hidden_size_1e7", lambda t: ["model.tiny.hidden_size=10000000"], ("model.tiny.hidden_size",)),
    ("microbatch_1e400", lambda t: ["trainer.max_tokens_per_microbatch=1e400"], ("trainer.max_tokens_per_microbatch",)),
    ("yaml_alias_bomb", _alias_bomb, ("bomb.yaml", "expands to more than")),
    ("config_dev_zero", lambda t: ["CONFIG=/dev/zero"], ("/dev/zero", "not a regular file")),
    # ---- the engine, rewards
    ("engine_args_unknown", lambda t: ["rollout.engine_args={bogus: 1}"], ("rollout.engine_args.bogus", "accepts")),
    ("engine_args_bad_value", lambda t: ["rollout.engine_args={dtype: float64}"], ("rollout.engine_args", "dtype")),
    (
        "user_engine_missing",
        lambda t: ["rollout.engine=no_such_module_qq:Engine"],
        ("rollout.engine", "no_such_module"),
    ),
    ("reward_builtins_eval", lambda t: ["data.task=builtins:eval"], ("data.task", "refused")),
    ("reward_os_system", lambda t: ["data.task=os:system"], ("data.task", "refused")),
    # ---- paths and the model
    ("hf_config_missing", lambda t: ["model.tiny=null", f"model.hf_config={t / 'nope'}"], ("model.hf_config", "nope")),
    ("model_type_unsupported", lambda t: _hf_model(t, model_type="mistral"), ("model.hf_config", "mistral")),
    ("hf_config_incomplete", lambda t: _hf_model(t, hidden_size=None), ("model.hf_config", "hidden_size")),
    (
        "tp_not_dividing_heads",
        lambda t: _hf_model(t) + ["parallel.num_actor_ranks=4", "parallel.tensor_model_parallel_size=4"],
        ("parallel.tensor_model_parallel_size", "6 attention heads"),
    ),
    ("tokenizer_missing", lambda t: [f"model.tokenizer={t / 'no_tok'}"], ("model.tokenizer", "no_tok")),
    (
        "initial_weights_missing",
        lambda t: ["model.init=pretrained", f"model.checkpoint={t / 'no_weights'}"],
        ("model.checkpoint", "no_weights", "holds no initial weights"),
    ),
    ("output_dir_is_a_file", lambda t: [f"trainer.output_dir={_jsonl(t, 'f.jsonl', [ROW])}"], ("trainer.output_dir",)),
    ("output_dir_unwritable", lambda t: ["trainer.output_dir=/proc/megatron_rl_runs"], ("trainer.output_dir", "/proc")),
    ("resume_missing", lambda t: [f"trainer.resume={t / 'no_ckpt'}"], ("trainer.resume", "no_ckpt")),
    # ---- data files and rows
    ("train_files_empty_list", lambda t: ["data.train_files=[]"], ("data.train_files", "empty")),
    ("train_file_missing", lambda t: [f"data.train_files=[{t / 'nope.jsonl'}]"], ("nope.jsonl", "no such file")),
    ("train_file_empty", lambda t: _train_file(t, "e.jsonl", []), ("e.jsonl", "no rows")),
    ("row_not_utf8", lambda t: _train_file(t, "l.jsonl", [ROW] * 3, raw={2: LATIN1_ROW}), ("l.jsonl, row 2", "UTF-8")),
    (
        "prompt_too_long",
        lambda t: _train_file(t, "p.jsonl", [ROW] * 3 + [{**ROW, "prompt": LONG_PROMPT}]),
        ("p.jsonl, row 4", "rollout.max_prompt_tokens=16"),
    ),
    (
        "eval_prompt_too_long",
        lambda t: [f"data.eval_files=[{_jsonl(t, 'ev.jsonl', [{**ROW, 'prompt': LONG_PROMPT}])}]"],
        ("ev.jsonl, row 1", "max_prompt_tokens"),
    ),
    ("row_invalid_json", lambda t: _train_file(t, "j.jsonl", [ROW] * 2, raw={2: b"{oops"}), ("j.jsonl, row 2", "JSON")),
    (
        "row_without_truth",
        lambda t: _train_file(t, "g.jsonl", [{"prompt": "copy 1 ="}]),
        ("g.jsonl, row 1", "ground_truth"),
    ),
    ("data_file_csv", lambda t: _train_file(t, "d.csv", [ROW]), ("d.csv", "unsupported file type")),
    # ---- the checkpoint to resume from
    (
        "resume_lr_differs",
        lambda t: _resume(t, "trainer.lr=5e-5"),
        ("trainer.lr", "got 5e-05", "resume_optimizer_schedule"),
    ),
    (
        "resume_lora_adapters_without_their_base",
        lambda t: _resume(t, base_weights={"path": "/ckpt/base", "fingerprint": "ab" * 32}),
        ("model.init", "holds LoRA adapters only, trained over the base weights of /ckpt/base", "a random init"),
    ),
    (
        "resume_min_lr_differs",
        lambda t: _resume(t, scheduler={**tiny_scheduler(), "min_lr": 1e-5}),
        ("trainer.min_lr", "1e-05"),
    ),
    ("resume_warmup_differs", lambda t: _resume(t, "trainer.lr_warmup_steps=5"), ("trainer.lr_warmup_steps",)),
    ("resume_schedule_differs", lambda t: _resume(t, "trainer.lr_schedule=linear"), ("trainer.lr_schedule",)),
    ("resume_weight_decay_differs", lambda t: _resume(t, "trainer.weight_decay=0.1"), ("trainer.weight_decay",)),
    ("resume_adam_differs", lambda t: _resume(t, "trainer.adam_beta2=0.99"), ("trainer.adam_beta2",)),
    (
        "resume_decay_length_differs",
        lambda t: _resume(
            t,
            "trainer.lr_schedule=cosine",
            "trainer.num_steps=50",
            scheduler={**tiny_scheduler(), "lr_decay_style": "cosine"},
        ),  # fmt: skip
        ("trainer.num_steps", "decay over 50 optimizer steps", "decays over 800"),
    ),
    ("resume_rows_differ", lambda t: _resume(t, num_rows=799), ("data.train_files", "799")),
    (
        "resume_all_broken",
        lambda t: _resume(t, broken=("step_000001", "step_000002")),
        ("trainer.resume", "no intact checkpoint", "step_000001"),
    ),
    (
        "resume_explicit_broken",
        lambda t: _resume(t, f"trainer.resume={t / 'out/tiny_cpu/checkpoints/step_000002'}", broken=("step_000002",)),
        ("trainer.resume", "step_000002"),
    ),
    ("resume_never_with_checkpoints", lambda t: _resume(t, "trainer.resume=never"), ("already holds checkpoints",)),
]


def _args(tmp_path: Path, extra: list[str], *, dry_run: bool = True) -> list[str]:
    config = next((e.partition("=")[2] for e in extra if e.startswith("CONFIG=")), str(EXAMPLE))
    overrides = [e for e in extra if not e.startswith("CONFIG=")]
    args = ["train", config, f"trainer.output_dir={tmp_path / 'out'}", *TOY_PATHS, *overrides]
    return args + (["--dry-run"] if dry_run else [])


def test_the_table_covers_every_area_of_the_issue():
    assert len(CASES) >= 50 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("setup, needles", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_exits_2_naming_it_without_a_traceback(tmp_path, capsys, setup, needles):
    assert cli.main(_args(tmp_path, setup(tmp_path))) == 2
    err = capsys.readouterr().err
    assert "error: " in err and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)
    assert not (tmp_path / "out" / "tiny_cpu" / "config.yaml").exists()  # nothing was written


def test_vllm_without_vllm_is_named(tmp_path, capsys, monkeypatch):
    real = importlib.util.find_spec
    # vLLM absent, whether or not this environment has it (CI installs it)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None if name == "vllm" else real(name, *a, **k))
    assert cli.main(_args(tmp_path, ["rollout.engine=vllm"])) == 2
    err = capsys.readouterr().err
    assert "rollout.engine" in err and "install_vllm_cpu.sh" in err and "Traceback" not in err


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_a_head_size_vllms_cpu_build_cannot_run_is_refused_before_start(tmp_path, capsys):
    """The tiny demo's head_dim 16: vllm-cpu's attention fails at the first generation."""
    from importlib import metadata

    try:
        metadata.distribution("vllm-cpu")
    except metadata.PackageNotFoundError:
        pytest.skip("the installed vLLM is not the CPU build")
    assert cli.main(_args(tmp_path, ["rollout.engine=vllm"])) == 2
    err = capsys.readouterr().err
    assert "config field 'rollout.engine'" in err and "head_dim is 16" in err and "Traceback" not in err


# --------------------------------------------------------------------------- legal but suspicious: warned


def test_duplicate_row_ids_are_warned_about_naming_both_rows(tmp_path, capsys):
    train = _jsonl(tmp_path, "t.jsonl", [{**ROW, "id": "a"}, {**ROW, "id": "b"}, {**ROW, "id": "a"}])
    evals = _jsonl(tmp_path, "e.jsonl", [{**ROW, "id": "b"}])
    assert cli.main(_args(tmp_path, [f"data.train_files=[{train}]", f"data.eval_files=[{evals}]"])) == 0
    err = capsys.readouterr().err
    assert f"warning: config field 'data.train_files': 1 row(s) repeat an earlier row's id, e.g. {train} row 3" in err
    assert (
        f"warning: config field 'data.eval_files': 1 eval row(s) repeat a training row's id, e.g. {evals} row 1" in err
    )


def test_a_broken_latest_checkpoint_is_named_and_skipped(tmp_path, capsys):
    folder = tmp_path / "out" / "tiny_cpu" / "checkpoints"
    assert cli.main(_args(tmp_path, _resume(tmp_path, broken=("step_000002",)))) == 0
    err = capsys.readouterr().err
    assert f"warning: config field 'trainer.resume': {folder / 'step_000002'}: __0_0.distcp has 7 bytes" in err
    assert f"resuming from {folder / 'step_000001'}" in err


def test_resume_may_keep_the_checkpoints_optimizer_settings(tmp_path, capsys):
    args = _args(tmp_path, _resume(tmp_path, "trainer.lr=5e-5", "trainer.resume_optimizer_schedule=checkpoint"))
    lr = tiny_scheduler()["max_lr"]
    assert cli.main(args) == 0
    assert f"warning: config field 'trainer.lr': 5e-05 replaced by the checkpoint's {lr!r}" in capsys.readouterr().err
    saved = yaml.safe_load((tmp_path / "out" / "tiny_cpu" / "config.yaml").read_text())
    assert saved["trainer"]["lr"] == lr  # the saved config says what the run trains with


# --------------------------------------------------------------------------- as real subprocesses


@pytest.mark.parametrize("case", ["lr_inf", "yaml_alias_bomb", "eval_prompt_too_long", "resume_lr_differs"])
def test_real_train_subprocess_exits_2_before_start_up(tmp_path, case):
    setup, needles = next(c[1:] for c in CASES if c[0] == case)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_rl", *_args(tmp_path, setup(tmp_path), dry_run=False)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and all(n in proc.stderr for n in needles), proc.stderr
    assert "Ray" not in proc.stderr  # nothing started
