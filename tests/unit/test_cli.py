"""The ``megatron-rl`` command line: in-process ``main([...])`` for speed, a few real subprocesses.

Every test points ``trainer.output_dir`` at ``tmp_path`` so nothing is written into the repo.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_rl import cli
from megatron_rl.config.lib import to_dict
from megatron_rl.config.run import load_run_config
from megatron_rl.rewards import reward

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = str(REPO / "examples" / "tiny_cpu.yaml")
TOY = REPO / "examples" / "data" / "toy"
# The dry run checks every path (tokenizer, data), so they must not depend on the working directory.
TOY_PATHS = [
    f"model.tokenizer={TOY / 'tokenizer'}",
    f"data.train_files=[{TOY / 'train.jsonl'}]",
    f"data.eval_files=[{TOY / 'test.jsonl'}]",
]


def _dry_run_args(tmp_path: Path, *overrides: str) -> list[str]:
    return ["train", EXAMPLE, f"trainer.output_dir={tmp_path}", *TOY_PATHS, *overrides, "--dry-run"]


def _run_module(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-m", "megatron_rl", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


# --------------------------------------------------------------------------- in-process


def test_dry_run_prints_and_saves_resolved_config(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(_dry_run_args(tmp_path, "trainer.lr=3e-4")) == 0
    out, err = capsys.readouterr()
    expected = load_run_config(EXAMPLE, [f"trainer.output_dir={tmp_path}", *TOY_PATHS, "trainer.lr=3e-4"])
    assert yaml.safe_load(out) == to_dict(expected)  # stdout is plain YAML when not a terminal
    saved = tmp_path / "tiny_cpu" / "config.yaml"
    assert load_run_config(saved) == expected
    assert "TP 1 x PP 1" in err and str(saved) in err


def test_dry_run_on_a_terminal_uses_rich(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert cli.main(_dry_run_args(tmp_path)) == 0
    assert "tiny_cpu" in capsys.readouterr().out


def test_warnings_are_printed_as_one_line(tmp_path, capsys):
    assert cli.main(_dry_run_args(tmp_path, "algorithm.constant_normalizer=64")) == 0
    err = capsys.readouterr().err
    assert "warning: config field 'algorithm.constant_normalizer'" in err
    assert "ConfigWarning" not in err  # no file:line noise for users


def test_typo_key_exits_2_with_suggestion(tmp_path, capsys):
    assert cli.main(_dry_run_args(tmp_path, "trainer.lrr=1e-6")) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: config field 'trainer.lrr'")
    assert "did you mean 'lr'?" in err and "Traceback" not in err
    assert not (tmp_path / "tiny_cpu").exists()


def test_out_of_range_exits_2_naming_field(tmp_path, capsys):
    assert cli.main(_dry_run_args(tmp_path, "algorithm.ar.alpha=2")) == 2
    err = capsys.readouterr().err
    assert "algorithm.ar.alpha" in err and "[0.0, 1.0]" in err


def test_unknown_advantage_estimator_lists_registered(tmp_path, capsys):
    from megatron_rl.algo import advantages

    assert cli.main(_dry_run_args(tmp_path, "algorithm.advantage.estimator=grpoo")) == 2
    err = capsys.readouterr().err
    assert "error: config field 'algorithm.advantage.estimator'" in err and "grpoo" in err
    for name in advantages.registered_advantages():
        assert name in err


def test_missing_config_file_exits_2(tmp_path, capsys):
    assert cli.main(["train", str(tmp_path / "nope.yaml"), "--dry-run"]) == 2
    assert "nope.yaml" in capsys.readouterr().err


def test_malformed_override_exits_2(tmp_path, capsys):
    assert cli.main(_dry_run_args(tmp_path, "trainer.lr")) == 2
    assert "malformed override" in capsys.readouterr().err


def test_train_with_a_missing_data_file_exits_2_naming_it(tmp_path, capsys):
    code = cli.main(["train", EXAMPLE, f"trainer.output_dir={tmp_path}", "data.train_files=[nope.jsonl]"])
    assert code == 2
    assert "nope.jsonl" in capsys.readouterr().err
    assert not list(tmp_path.rglob("checkpoints"))


def test_train_without_dry_run_still_validates(tmp_path, capsys):
    assert cli.main(["train", EXAMPLE, f"trainer.output_dir={tmp_path}", "rollout.top_p=2"]) == 2
    assert "rollout.top_p" in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"megatron-rl {importlib.metadata.version('megatron_rl')}"


def test_no_subcommand_prints_help_and_exits_2(capsys):
    assert cli.main([]) == 2
    assert "train" in capsys.readouterr().err


def test_register_subcommand(monkeypatch, capsys):
    monkeypatch.setattr(cli, "SUBCOMMANDS", dict(cli.SUBCOMMANDS))

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--name", default="world")

    def run(args: argparse.Namespace) -> int:
        print(f"hello {args.name}")
        return 0

    cli.register_subcommand("hello", help="say hello", add_arguments=add_arguments, run=run)
    assert cli.main(["hello", "--name", "rl"]) == 0
    assert capsys.readouterr().out == "hello rl\n"
    with pytest.raises(ValueError, match="already registered"):
        cli.register_subcommand("train", help="x", add_arguments=add_arguments, run=run)


# --------------------------------------------------------------------------- subprocess


def test_module_dry_run_subprocess(tmp_path):
    proc = _run_module(*_dry_run_args(tmp_path), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(proc.stdout)["logging"]["run_name"] == "tiny_cpu"
    assert (tmp_path / "tiny_cpu" / "config.yaml").is_file()


def test_module_typo_exits_2_subprocess(tmp_path):
    proc = _run_module(*_dry_run_args(tmp_path, "rollout.num_sample_per_prompt=2"), cwd=tmp_path)
    assert proc.returncode == 2
    assert "rollout.num_sample_per_prompt" in proc.stderr and "num_samples_per_prompt" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_module_out_of_range_subprocess(tmp_path):
    proc = _run_module(*_dry_run_args(tmp_path, "algorithm.ar.alpha=2"), cwd=tmp_path)
    assert proc.returncode != 0
    assert "algorithm.ar.alpha" in proc.stderr and "Traceback" not in proc.stderr


def test_module_version_subprocess(tmp_path):
    proc = _run_module("--version", cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.startswith("megatron-rl ")


def test_convert_subcommand_is_registered_and_reports_bad_input(tmp_path, capsys):
    assert "convert" in cli.SUBCOMMANDS
    code = cli.main(["convert", "hf-to-mcore", "--hf", str(tmp_path / "missing"), "--out", str(tmp_path / "out")])
    assert code == 1
    err = capsys.readouterr().err
    assert "error:" in err and "missing" in err
    assert not (tmp_path / "out").exists()


def test_unknown_reward_is_named(tmp_path, capsys):
    assert cli.main(_dry_run_args(tmp_path, "data.reward=kk_logik")) == 2
    err = capsys.readouterr().err
    assert "data.reward" in err and "kk_logic" in err


def test_generate_data_subcommand_writes_toy_data(tmp_path):
    assert cli.main(["generate-data", "toy", "--out", str(tmp_path / "toy")]) == 0
    assert any((tmp_path / "toy").glob("*.jsonl"))


def test_overrides_may_follow_the_dry_run_flag(tmp_path, capsys):
    assert cli.main(["train", EXAMPLE, "--dry-run", f"trainer.output_dir={tmp_path}", "algorithm.ar.alpha=0.3"]) == 0
    assert "alpha: 0.3" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["train", EXAMPLE, "--dry-run", "--bogus"])


# --------------------------------------------------------------------------- task and model checks


@reward
def echo_reward(response, ground_truth):
    """A user reward function for ``data.task=module:function``."""
    return float(response == ground_truth)


def undeclared_reward(response, ground_truth):
    """A function not declared a reward: usable only from a module the config trusts."""
    return float(response == ground_truth)


def test_renamed_task_key_is_a_one_line_warning(tmp_path, capsys):
    assert cli.main(_dry_run_args(tmp_path, "data.reward=toy_copy")) == 0
    out, err = capsys.readouterr()
    assert "warning: config field 'data.reward': is renamed; write 'data.task'" in err
    assert "FutureWarning" not in err and "ConfigRenameWarning" not in err
    assert yaml.safe_load(out)["data"]["task"] == "toy_copy"


def test_unknown_task_is_named_as_data_task(tmp_path, capsys):
    assert cli.main(_dry_run_args(tmp_path, "data.task=kk_logik")) == 2
    err = capsys.readouterr().err
    assert "error: config field 'data.task': unknown task 'kk_logik'" in err
    assert "data.reward" not in err and "kk_logic" in err and "toy_copy" in err


def test_user_reward_function_is_a_task(tmp_path, capsys):
    assert cli.main(_dry_run_args(tmp_path, f"data.task={__name__}:echo_reward")) == 0
    assert cli.main(_dry_run_args(tmp_path, f"data.task={__name__}:no_such_fn")) == 2
    err = capsys.readouterr().err
    assert "error: config field 'data.task'" in err and "has no attribute 'no_such_fn'" in err
    assert cli.main(_dry_run_args(tmp_path, f"data.task={__name__}:undeclared_reward")) == 2
    assert "is not declared a reward" in capsys.readouterr().err
    args = _dry_run_args(tmp_path, f"data.task={__name__}:undeclared_reward", f"data.reward_modules=[{__name__}]")
    assert cli.main(args) == 0


def test_cprofile_run_as_the_reward_runs_nothing(tmp_path, capsys):
    # cProfile.run(response) would execute each response; the dry run refuses it by name.
    assert cli.main(_dry_run_args(tmp_path, "data.task=cProfile:run")) == 2
    err = capsys.readouterr().err
    assert "error: config field 'data.task'" in err and "'run' is not declared a reward" in err


def test_unknown_tiny_model_type_lists_registered(tmp_path, capsys):
    assert cli.main(_dry_run_args(tmp_path, "model.tiny.model_type=mistral")) == 2
    err = capsys.readouterr().err
    assert "error: config field 'model.tiny.model_type': unknown model type 'mistral'; registered: " in err
    assert "llama, qwen2, qwen3" in err and not (tmp_path / "tiny_cpu").exists()


QWEN2_CONFIG = {
    "model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 32, "max_position_embeddings": 64,
}  # fmt: skip


def _hf_args(tmp_path: Path, hf_config: Path) -> list[str]:
    return _dry_run_args(tmp_path, "model.tiny=null", f"model.hf_config={hf_config}")


@pytest.mark.parametrize("as_file", [False, True], ids=["directory", "config_json"])
def test_hf_config_model_type_is_checked(tmp_path, capsys, as_file):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN2_CONFIG))  # the dry run reads the architecture
    source = model / "config.json" if as_file else model
    assert cli.main(_hf_args(tmp_path, source)) == 0
    (model / "config.json").write_text('{"model_type": "mistral"}')
    assert cli.main(_hf_args(tmp_path, source)) == 2
    err = capsys.readouterr().err
    assert f"error: config field 'model.hf_config': {model / 'config.json'}: unknown model type 'mistral'" in err


@pytest.mark.parametrize(
    "content, message",
    [(None, "does not exist"), ("{not json", "cannot read"), ('{"hidden_size": 8}', "has no 'model_type'")],
    ids=["missing", "not_json", "no_model_type"],
)
def test_unreadable_hf_config_is_named(tmp_path, capsys, content, message):
    model = tmp_path / "model"
    model.mkdir()
    if content is not None:
        (model / "config.json").write_text(content)
    path = model / "config.json"
    assert cli.main(_hf_args(tmp_path, path)) == 2
    err = capsys.readouterr().err
    assert "error: config field 'model.hf_config'" in err and str(path) in err and message in err
