"""An SFT run's config, rows and batches (``config/sft.py``, ``data/sft.py``, ``loop/sft.py``):
what is refused, named by field, file and row, before any process starts."""

from __future__ import annotations

import json

import pytest

from megatron_rl.cli import main
from megatron_rl.config.lib import ConfigError
from megatron_rl.config.sft import SFTDataConfig, SFTRunConfig
from megatron_rl.config.trainer import ActorConfig, TrainerConfig
from megatron_rl.data.loaders import DataError, SFTRow, load_sft_rows
from megatron_rl.data.prompts import PLAIN_STYLE, PromptStyle
from megatron_rl.data.sft import encode_sft_rows
from megatron_rl.tasks.toy import build_toy_tokenizer
from tests.e2e.conftest import SFT_EXAMPLE, tiny_overrides


@pytest.fixture(scope="module")
def tokenizer():
    return build_toy_tokenizer()


def _rows(*pairs: tuple[str, str]) -> list[SFTRow]:
    return [SFTRow(prompt=p, response=r, file="f.jsonl", row=i + 1) for i, (p, r) in enumerate(pairs)]


def test_rows_are_tokenised_apart_and_the_response_ends_with_eos(tokenizer):
    out = encode_sft_rows(_rows(("copy 3 1 4 =", "3 1 4"), ("copy 0 =", "0")), tokenizer, template="none",
                          style=PLAIN_STYLE, max_sequence_tokens=16)  # fmt: skip
    eos = tokenizer.eos_token_id
    assert out.prompt_ids[0] == tokenizer.encode("copy 3 1 4 =", add_special_tokens=False)
    assert out.response_ids[0] == tokenizer.encode("3 1 4", add_special_tokens=False) + [eos]
    assert out.response_ids[1][-1] == eos and len(out) == 2


def test_the_prompt_is_rendered_with_the_tasks_style(tokenizer):
    style = PromptStyle(system_prompt="be brief", assistant_prefill="<think>")
    out = encode_sft_rows(_rows(("q", "a")), tokenizer, template="literal", style=style, max_sequence_tokens=512)
    # The literal ChatML text, which the toy tokenizer maps word by word (unknown words -> <unk>).
    text = "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n<think>"
    assert out.prompt_ids[0] == tokenizer.encode(text, add_special_tokens=False)


def test_a_row_too_long_or_empty_is_named(tokenizer):
    with pytest.raises(DataError, match=r"f.jsonl, row 2, field 'response': prompt \(5 tokens\) \+ .*\(4\) = 9 tokens.*max_sequence_tokens=8"):
        encode_sft_rows(_rows(("copy 1 =", "1"), ("copy 3 1 4 =", "3 1 4")), tokenizer, template="none",
                        style=PLAIN_STYLE, max_sequence_tokens=8)  # fmt: skip
    with pytest.raises(DataError, match="row 1, field 'response': the response is empty after tokenisation"):
        encode_sft_rows(_rows(("copy 1 =", " \t")), tokenizer, template="none", style=PLAIN_STYLE, max_sequence_tokens=8)


def test_bad_rows_are_named_by_file_row_and_field(tmp_path):
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"prompt": "p", "answer": "a"}) + "\n" + json.dumps({"prompt": "p", "answer": 3}) + "\n")
    with pytest.raises(DataError, match=r"sft.jsonl, row 1, field 'response': response is missing"):
        load_sft_rows(path)
    with pytest.raises(DataError, match=r"sft.jsonl, row 2, field 'answer': response must be a string, got int"):
        load_sft_rows(path, response_key="answer")
    nested = tmp_path / "nested.jsonl"  # dotted keys reach into objects, as for RL rows
    nested.write_text(json.dumps({"q": "p", "gt": {"text": "a b"}}) + "\n")
    (row,) = load_sft_rows(nested, prompt_key="q", response_key="gt.text")
    assert (row.prompt, row.response, row.row) == ("p", "a b", 1)


REFUSED = {
    "trainer.num_minibatches_per_step": lambda: {"trainer": TrainerConfig(num_minibatches_per_step=2)},
    "trainer.num_epochs_per_step": lambda: {"trainer": TrainerConfig(num_epochs_per_step=2)},
    "actor.reference_offload": lambda: {"actor": ActorConfig(reference_offload=True)},
    "actor.old_logp_source": lambda: {"actor": ActorConfig(old_logp_source="recompute")},
    "trainer.max_tokens_per_microbatch": lambda: {"trainer": TrainerConfig(max_tokens_per_microbatch=100)},
    "data.max_sequence_tokens": lambda: {"data": SFTDataConfig(max_sequence_tokens=4096)},  # the tiny model's positions
    "response_key": lambda: {"data": SFTDataConfig(response_key="prompt")},
}


@pytest.mark.parametrize("field", list(REFUSED))
def test_settings_an_sft_run_cannot_act_on_are_refused(field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        SFTRunConfig(**REFUSED[field]())


def test_dry_run_names_a_bad_row_and_starts_nothing(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "copy 1 =", "ground_truth": "1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7"}) + "\n")
    code = main(["sft", str(SFT_EXAMPLE), "--dry-run", *tiny_overrides(tmp_path), f"data.train_files=[{bad}]"])
    err = capsys.readouterr().err
    assert code == 2 and f"{bad}, row 1, field 'response'" in err and "data.max_sequence_tokens=16" in err
    assert not (tmp_path / "tiny_cpu_sft").exists() or not any((tmp_path / "tiny_cpu_sft").iterdir())
    code = main(["sft", str(SFT_EXAMPLE), "--dry-run", *tiny_overrides(tmp_path)])
    assert code == 0 and (tmp_path / "tiny_cpu_sft" / "config.yaml").is_file()


def test_docs_sft_config_md_is_up_to_date():
    from pathlib import Path

    from megatron_rl.config.sft import sft_config_reference

    docs = Path(__file__).resolve().parents[2] / "docs" / "sft_config.md"
    assert docs.read_text(encoding="utf-8") == sft_config_reference(), (
        "docs/sft_config.md is stale; regenerate it with: python -m megatron_rl.config sft > docs/sft_config.md"
    )


def test_the_kk_cpu_examples_load_and_rl_starts_from_the_sft_runs_last_checkpoint():
    """examples/kk_cpu: the RL config builds the SFT config's model and starts from the
    checkpoint its last step writes, with its tokenizer and rows."""
    from pathlib import Path

    from megatron_rl.config.run import load_run_config
    from megatron_rl.config.sft import load_sft_config

    root = Path(__file__).resolve().parents[2] / "examples" / "kk_cpu"
    sft, rl = load_sft_config(root / "sft.yaml"), load_run_config(root / "rl.yaml")
    assert rl.model.tiny == sft.model.tiny and rl.model.tokenizer == sft.model.tokenizer
    assert rl.model.init == "pretrained" and sft.model.init == "random"
    assert Path(rl.model.checkpoint) == sft.run_dir / "checkpoints" / f"step_{sft.trainer.num_steps:06d}"
    assert sft.trainer.save_final or sft.trainer.num_steps % sft.trainer.save_every_steps == 0
    assert rl.data.train_files == sft.data.train_files and rl.data.task == sft.data.task == "kk_logic"
    assert rl.data.prompt_template == sft.data.prompt_template == "literal"
    # Every row fits both runs: the longest trace (3 people) is 631 tokens after a 224-token prompt.
    positions = sft.model.tiny.max_position_embeddings
    assert 224 + 631 <= sft.data.max_sequence_tokens <= positions
    assert rl.rollout.max_prompt_tokens >= 224 and rl.rollout.max_new_tokens >= 631
    assert rl.rollout.max_prompt_tokens + rl.rollout.max_new_tokens <= positions
