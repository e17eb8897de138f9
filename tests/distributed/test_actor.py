"""The Megatron actor on CPU/gloo: TP/PP/DP invariance, log-probs, checkpoints, weight export.

One job of 4 forked ranks (tests/helpers/actor_worker.py) runs every multi-rank check
on tiny random HF models (hidden 64, 2 layers, vocab 250 -> padded 256, fp32) and each
rank writes a JSON report; the tests below assert on it. Layouts (TP, PP) x DP of the 4
ranks: (1,1)x4, (2,1)x2, (1,2)x2, (2,2)x1, all on the same 8-sequence batch.

* the same loss, grad norm and updated weights at every layout (<= 1e-5, fp32), for a
  GRPO+KL+entropy step and an AR+Lopti+STAPO step (STAPO's threshold gathered over DP);
* an SFT step (``MegatronActor.sft_step``) after them: its loss equals transformers' float64
  cross-entropy of the response tokens (temperature 1), and loss, grad norm and weights
  agree across the layouts;
* the number of micro-batches (1 vs 3 at TP=2 x PP=2) does not change the update (RL or SFT);
* log-probs / entropies equal a transformers forward (<= 1e-4) for Qwen2 (untied and
  tied), Qwen3 and Llama, and every rank returns the same values;
* save at TP=2 -> load -> one more step is bit-identical to not stopping (optimizer
  state incl. Adam step round-trips exactly); the TP=2 checkpoint loads at TP=1 with
  the same log-probs; with ``fully_reshardable`` optimizer state a TP=2 checkpoint
  resumes at TP=1 x PP=2 like not stopping; the checkpoint exports with ``mcore-to-hf``
  bit-exactly;
* a step with a NaN advantage is skipped (weights and Adam step untouched) and counted;
* ``iter_hf_weights`` at every layout returns exactly the source HF state dict;
  ``load_hf_weights`` (HF safetensors straight into shards) equals the converted path;
* tied embeddings at PP=2 (embedding gradient shared by the first and last stage);
* a bf16 step runs (fp32 master weights) and stays close to the fp32 one.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.models.convert.hf_mcore import McoreToHfOptions, mcore_to_hf

LAYOUTS = ("tp1_pp1", "tp2_pp1", "tp1_pp2", "tp2_pp2")
TOL = 1e-5


@pytest.fixture(scope="module")
def job(actor_job) -> dict:
    return actor_job


def _close(a: float, b: float, tol: float = TOL) -> bool:
    return math.isfinite(a) and abs(a - b) <= tol * max(1.0, abs(b))


# ----------------------------------------------------------------------------- layouts


@pytest.mark.parametrize("step", ["step1", "step2"])
def test_layouts_give_the_same_step(job, step):
    layouts = job["r0"]["layouts"]
    ref = layouts["tp1_pp1"][step]
    assert ref["actor/step_skipped"] == 0.0 and ref["loss/total"] != 0.0
    for key in LAYOUTS:
        m = layouts[key][step]
        assert _close(m["loss/total"], ref["loss/total"]), (key, m["loss/total"], ref["loss/total"])
        assert _close(m["actor/grad_norm"], ref["actor/grad_norm"]), (key, m["actor/grad_norm"], ref["actor/grad_norm"])
        assert layouts[key][f"weights_{step}_vs_tp1_pp1"] <= TOL, key
        # The token sets (Lopti split, STAPO mask) and token counts agree exactly.
        for name in ("loss/active_tokens", "loss/stapo/masked_frac", "loss/lopti/low_frac"):
            assert m.get(name) == ref.get(name), (key, name)
        for name, value in ref.items():
            if name.startswith("loss/") and name != "loss/total":
                assert _close(m[name], value, 1e-5), (key, name, m[name], value)
    # The update is real: weights move by about lr, far above the tolerance.
    assert job["r0"]["weights_step1_change"] > 50 * TOL


def test_sft_step_is_the_float64_cross_entropy_at_every_layout(job):
    # Step 3 is MegatronActor.sft_step: loss = mean NLL of the response tokens at temperature 1
    # (the rollout temperature, 0.7, must not enter), over DP 4/2/2/1 and 1-3 micro-batches.
    layouts = job["r0"]["layouts"]
    ref = layouts["tp1_pp1"]["step3"]
    for key in LAYOUTS:
        m = layouts[key]["step3"]
        assert m["actor/step_skipped"] == 0.0
        assert abs(m["loss/total"] - layouts[key]["sft_nll_float64"]) <= TOL, (key, m["loss/total"])
        assert m["loss/nll"] == pytest.approx(m["loss/total"], rel=1e-6)  # float64 sum of float32 terms vs the loss sum
        assert m["loss/active_tokens"] == layouts[key]["step1"]["loss/active_tokens"] > 0  # every response token
        assert _close(m["actor/grad_norm"], ref["actor/grad_norm"]), (key, m["actor/grad_norm"], ref["actor/grad_norm"])
        assert layouts[key]["weights_step3_vs_tp1_pp1"] <= TOL, key
    assert ref["actor/grad_norm"] > 0.1 and 1.0 < ref["loss/total"] < 20.0  # a real gradient on a ~log(250) loss


def test_second_step_exercises_ar_lopti_stapo(job):
    m = job["r0"]["layouts"]["tp2_pp1"]["step2"]
    assert 0.0 < m["loss/lopti/low_frac"] < 1.0
    assert 0.0 < m["loss/stapo/masked_frac"] < 1.0
    assert 0.7 <= m["loss/ar/weight_mean"] <= 1.0


def test_microbatch_count_does_not_change_the_update(job):
    mb = job["r0"]["microbatches"]
    assert mb["counts"] == [1.0, 3.0]
    assert _close(mb["loss"][1], mb["loss"][0]) and _close(mb["grad_norm"][1], mb["grad_norm"][0])
    assert mb["weights_max_diff"] <= TOL
    # ... nor the SFT step's
    assert mb["sft_counts"] == [1.0, 3.0]
    assert _close(mb["sft_loss"][1], mb["sft_loss"][0]) and _close(mb["sft_grad_norm"][1], mb["sft_grad_norm"][0])
    assert mb["sft_weights_max_diff"] <= TOL


def test_tied_embeddings_with_pipeline_parallelism(job):
    tied = job["r0"]["tied"]
    assert _close(tied["loss"][1], tied["loss"][0]) and _close(tied["grad_norm"][1], tied["grad_norm"][0])
    assert tied["weights_max_diff"] <= TOL
    assert not tied["has_lm_head"]


# ----------------------------------------------------------------------------- log-probs


def test_logprobs_match_transformers(job):
    r0 = job["r0"]
    for key in LAYOUTS:
        entry = r0["layouts"][key]
        assert entry["logp_vs_hf"] <= 1e-4 and entry["entropy_vs_hf"] <= 1e-4, key
        assert entry["logp_padding_zero"], key
        assert entry["logp_vs_tp1_pp1"] <= TOL, key
    assert r0["tied"]["logp_vs_hf"] <= 1e-4 and r0["tied"]["logp_max_diff"] <= TOL
    for arch, entry in r0["other_archs"].items():
        assert entry["logp_vs_hf"] <= 1e-4 and entry["entropy_vs_hf"] <= 1e-4, arch


def test_logprobs_are_returned_on_every_rank(job):
    for key in LAYOUTS:
        sums = {r["layouts"][key]["logp_sum"] for r in job["reports"]}
        assert len(sums) == 1, (key, sums)


# ----------------------------------------------------------------------------- checkpoints


def test_resume_is_bit_identical(job):
    resume = job["r0"]["resume"]
    assert resume["record"] == {"loaded_optimizer": True, "train_steps": 1, "optimizer_steps": 1, "adam_step": 1.0}
    assert resume["counters"] == [1, 1, 0] and resume["scheduler_steps"] == 1
    assert resume["optimizer_keys_equal"] and resume["optimizer_state_max_diff"] == 0.0
    assert resume["adam_step_after_load"] == 1.0 and resume["adam_step_after_step"] == 2.0
    assert resume["weights_bit_identical"]
    for name in ("loss/total", "actor/grad_norm", "loss/stapo/masked_frac"):
        assert resume["step2"][name] == resume["step2_continuous"][name], name
    for report in job["reports"]:  # every rank restored its optimizer shard exactly
        assert report["resume"]["optimizer_state_max_diff"] == 0.0 and report["resume"]["weights_bit_identical"]


def test_tp2_checkpoint_loads_at_tp1(job):
    reshard = job["r0"]["reshard_tp2_to_tp1"]
    assert not reshard["loaded_optimizer"]  # dp_reshardable: optimizer state reshards over DP only
    assert reshard["logp_max_diff"] <= TOL
    assert reshard["counters"] == [1, 1]


def test_fully_reshardable_optimizer_resumes_at_another_layout(job):
    resume = job["r0"]["reshard_optimizer_tp2_to_pp2"]
    assert resume["loaded_optimizer"] and resume["optimizer_sharding"] == "fully_reshardable"
    assert resume["adam_step_after_step"] == 2.0
    assert _close(*resume["loss"]) and _close(*resume["grad_norm"])
    # With fresh Adam moments the update would differ by ~lr (1e-3).
    assert resume["weights_vs_continuous"] <= TOL


def test_checkpoint_on_disk_and_export(job, tmp_path):
    ckpt_root = Path(job["spec"]["work_dir"]) / "ckpt"
    assert (ckpt_root / "latest").read_text() == "step_1\n"
    assert sorted(p.name for p in ckpt_root.iterdir()) == ["latest", "step_1"]  # no temporary leftovers
    step = ckpt_root / "step_1"
    state = json.loads((step / "actor_state.json").read_text())
    assert state["layout"] == {"tp": 2, "pp": 1, "dp": 2, "ep": 1, "etp": 2} and state["adam_step"] == 1.0
    assert state["optimizer_sharding"] == "dp_reshardable"
    assert sorted(p.name for p in (step / "rng").iterdir()) == [f"rank{r}.pt" for r in range(4)]
    hf_dir = Path(job["spec"]["variants"]["qwen2_gqa"]["hf_dir"])
    assert json.loads((step / "hf_config" / "config.json").read_text()) == json.loads((hf_dir / "config.json").read_text())
    assert (step / "hf_config" / "generation_config.json").is_file()

    # `megatron-rl convert mcore-to-hf` reads the training checkpoint (optimizer keys ignored)
    # and gives exactly what the actor's iter_hf_weights gave after the same step.
    mcore_to_hf(McoreToHfOptions(mcore_dir=step, out_dir=tmp_path / "hf"))
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    streamed = torch.load(job["out"] / "weights_tp2_pp1_step1.pt")
    assert sorted(exported) == sorted(streamed)
    for name, tensor in streamed.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name


# ----------------------------------------------------------------------------- robustness, weights


def test_nan_step_is_skipped_and_counted(job):
    entry = job["r0"]["layouts"]["tp1_pp2"]
    nan = entry["nan_step"]
    assert nan["metrics"]["actor/step_skipped"] == 1.0 and nan["metrics"]["actor/skipped_steps_total"] == 1.0
    assert nan["metrics"]["actor/optimizer_steps_total"] == 3.0  # two RL steps and an SFT step before it
    assert not math.isfinite(nan["metrics"]["loss/total"])
    assert nan["weights_unchanged"] and nan["adam_step"] == 3.0
    assert entry["after_nan_step"] == {
        "actor/step_skipped": 0.0, "actor/optimizer_steps_total": 4.0, "actor/skipped_steps_total": 1.0,
    }  # fmt: skip


def test_iter_hf_weights_is_the_hf_state_dict(job):
    # Bit-exact vs the HF source the weights came from, at every layout; tp2_pp2 was loaded
    # straight from HF safetensors (load_hf_weights), the others from the converted checkpoint.
    for key in LAYOUTS:
        for report in job["reports"]:  # every rank yields the full state dict
            assert report["layouts"][key]["hf_exact_after_load"], key


def test_bf16_step(job):
    bf16 = job["r0"]["bf16"]
    assert bf16["dtype"] == "torch.bfloat16" and bf16["weights_changed"] > 1e-4
    assert abs(bf16["loss"] - bf16["loss_fp32"]) <= 2e-2 * max(1.0, abs(bf16["loss_fp32"]))
    assert abs(bf16["grad_norm"] - bf16["grad_norm_fp32"]) <= 2e-2 * bf16["grad_norm_fp32"]
