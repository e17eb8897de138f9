"""Packed sequences (``trainer.pack_sequences``) against padded micro-batches on CPU/gloo.

One job of 2 forked ranks (tests/helpers/packing_worker.py) builds, at TP1 x DP2,
TP2 and PP2, a packed and a padded actor from the same HF weights and runs the same
mixed-length batch through both (small token budget: several micro-batches):

* per-token log-probs and entropies agree within 1e-5, and the packed ones equal a
  float64 transformers forward of each sequence alone;
* a sequence never attends across a packing boundary: changing one sequence's tokens
  leaves every other sequence's log-probs bit-identical;
* one optimizer step each with GRPO + KL + entropy, the seq-mean aggregations, AR,
  Lopti (both passes), TR-GRPO and STAPO: the same loss, grad norm and gradients
  (every element of megatron's ``main_grad``) within 1e-5, and the same weights after;
* ``actor/padding_fraction`` is lower packed than padded, and ``actor/packed_fraction``
  says which ran packed.
"""

from __future__ import annotations

import pytest

from tests.helpers.actor_job import REPO, run_actor_job

WORKER = REPO / "tests" / "helpers" / "packing_worker.py"
LAYOUTS = ("tp1_pp1", "tp2_pp1", "tp1_pp2")
TOL = 1e-5


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("packing")
    reports, _, _ = run_actor_job(WORKER, ["qwen2_gqa"], root, timeout_s=600, nproc=2)
    return reports


@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_logprobs_equal_padded_and_transformers(reports, layout):
    entry = reports[0][layout]
    assert entry["logp_packed_vs_padded"] <= TOL
    assert entry["entropy_packed_vs_padded"] <= TOL
    assert entry["logp_packed_vs_hf"] <= 1e-4  # float32 actor vs float64 transformers, sequence by sequence
    assert entry["logp_packed_padding_zero"]
    assert reports[1][layout]["logp_packed_vs_padded"] == entry["logp_packed_vs_padded"]  # every rank holds them


@pytest.mark.parametrize("layout", LAYOUTS)
def test_no_attention_across_a_packing_boundary(reports, layout):
    entry = reports[0][layout]
    assert entry["perturbed_row_change"] > 1e-3  # the change is visible where it should be
    assert entry["other_rows_change"] == 0.0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_and_padded_steps_agree(reports, layout):
    entry = reports[0][layout]
    for name, step in entry["steps"].items():
        loss_p, loss_d = step["loss"]
        norm_p, norm_d = step["grad_norm"]
        assert abs(loss_p - loss_d) <= TOL * max(1.0, abs(loss_d)), name
        assert norm_d > 0 and abs(norm_p - norm_d) <= TOL * max(1.0, norm_d), name
        assert step["max_grad_diff"] <= TOL * max(1.0, step["grad_scale"]), name
        packed_frac, padded_frac = step["padding_fraction"]
        assert packed_frac < padded_frac, name
        assert step["packed_fraction"] == [1.0, 0.0], name
    assert entry["logp_moved_by_steps"] > 1e-3  # the steps trained
    assert entry["logp_after_steps_packed_vs_padded"] <= 1e-4
