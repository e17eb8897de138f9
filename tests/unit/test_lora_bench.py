"""benchmarks/lora.py: one measured LoRA case at a toy size trains exactly its adapters
(the count the planner gives) with the reference as the actor with adapters off; the
planned tables show LoRA's gradients and Adam state far below full-parameter training's
at the same layout, and the 72B example on one node fitting 80 GB."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks" / "lora.py"


def test_a_toy_lora_case_trains_the_planned_adapters():
    from megatron_rl.cluster.planner import Architecture, lora_parameters
    from megatron_rl.config.trainer import LoRAConfig

    case = {"hidden": 64, "ffn": 128, "layers": 2, "heads": 4, "kv_heads": 2, "vocab": 256, "seq_len": 32, "seqs": 2,
            "lora_rank": 4, "reference": "resident"}  # fmt: skip
    done = subprocess.run([sys.executable, str(BENCH), "--case", json.dumps(case), "--steps", "2"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (report,) = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"benchmark": "lora"')]
    arch = Architecture(hidden_size=64, ffn_hidden_size=128, num_layers=2, num_attention_heads=4, num_query_groups=2,
                        head_dim=16, vocab_size=256, tie_word_embeddings=False, qkv_bias=True)  # fmt: skip
    assert report["trainable_parameters"] == lora_parameters(arch, LoRAConfig(rank=4), tp=1, pp=1)
    assert len(report["train_step_seconds"]) == 2 and report["train_step_peak_bytes"] > 0


def test_the_plans_cut_gradients_and_optimizer_state_and_fit_72b_on_one_node():
    done = subprocess.run([sys.executable, str(BENCH), "--plans-only"], capture_output=True, text=True, timeout=300,
                          cwd=REPO)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {(r["model"], r["run"]): r for r in map(json.loads, done.stdout.splitlines())}
    for model in ("14b", "32b", "72b"):
        full = rows[model, "full"]["gib"]
        for rank in (16, 64):
            lora = rows[model, f"lora_r{rank}"]
            assert lora["spec"] == "local" and rows[model, "full"]["spec"] == "transformer_engine"
            for name in ("gradients", "optimizer_state"):
                assert full[name] > 10 * lora["gib"][name], (model, rank, name)
    one_node = rows["72b_lora_one_node", "example"]
    assert one_node["gpus"] == 8 < rows["72b", "full"]["gpus"] and one_node["fits_80gb"]
