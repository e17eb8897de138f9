"""The mixture-of-experts actor (tiny Qwen3-MoE, 4 experts, top-2) on CPU/gloo, one job of
2 forked ranks (tests/helpers/actor_moe_worker.py): expert parallelism 2 equals 1 on the same
batch (log-probs, losses, the router's load-balancing loss, gradients, updated weights);
without the load-balancing term TP = 2 with sequence parallelism and PP = 2 (one replica)
equal EP (two replicas); the reported load-balancing loss and the term it adds to the
objective match a float64 computation from the routers' inputs; data-parallel ranks with
different micro-batch counts run fillers at EP = 2 and still equal EP = 1; a checkpoint
saved at EP = 2 resumes at EP = 2 like not stopping, and at EP = 1 with fresh Adam moments;
TP = 2 with whole experts (expert TP 1) at EP = 2 equals EP = 1, its weight sync reaches
rank 0 whole, and its checkpoint resumes at that layout and at TP = 1 like not stopping;
a full activation recompute changes nothing; routing replay equals transformers forced to
the same experts (padded, packed, EP = 2, TP = 2, PP = 2) and survives a recompute.
"""

from __future__ import annotations

import pytest

from tests.helpers.actor_job import REPO, run_actor_job

WORKER = REPO / "tests" / "helpers" / "actor_moe_worker.py"
TOL = 1e-5


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("actor_moe")
    reports, _, _ = run_actor_job(WORKER, ("qwen3_moe",), root, timeout_s=900, nproc=2)
    assert reports[1]["ep2_vs_ep1"] == reports[0]["ep2_vs_ep1"]  # every rank reports the same
    assert reports[1]["first_rank_sync"] == {"names": [], "diff": None}  # a sync's tensors reach rank 0 only
    assert reports[1]["etp1"]["first_rank_sync"] == {"names": [], "diff": None}
    assert reports[1]["pp2_sync"] == {"names": [], "diff": None}
    return reports[0]


def _same(case: dict, *, tol: float = TOL) -> None:
    assert case["logp"] <= tol, case
    for key, (a, b) in case["metrics"].items():
        if b is None:
            assert a is None, (key, case)
            continue
        assert abs(a - b) <= tol * max(1.0, abs(b)), (key, case)
    assert case["weights"] <= tol, case
    if "grads" in case:
        assert case["grads"] <= tol * max(1.0, case["grad_scale"]), case


def test_expert_parallel_2_equals_1_with_the_load_balancing_loss(report):
    case = report["ep2_vs_ep1"]
    _same(case)
    assert case["metrics"]["moe/load_balancing_loss"][1] > 1.0  # a real term (1 = perfect balance)
    assert case["metrics"]["loss/moe_aux"][1] > 0.0


def test_a_weight_sync_at_ep2_sends_every_expert_from_rank_0(report):
    """At EP = 2 the experts of DP replica 1's rank reach global rank 0 point to point."""
    sync = report["first_rank_sync"]
    assert any(".mlp.experts.3.down_proj." in n for n in sync["names"]) and sync["diff"] <= TOL, sync["diff"]


def test_the_built_in_engine_takes_the_sync_and_agrees_with_the_actor(report):
    """Synced from EP = 2 into transformers' fused experts (per-expert names as views), the
    engine's sampled tokens' log-probs equal the actor's within 1e-3 (float32 both)."""
    engine = report["engine"]
    assert engine["tokens"] == 32 and engine["max_abs_dlogp"] <= 1e-3, engine


def test_the_reported_router_loss_matches_float64_from_the_routers_inputs(report):
    mean, term = report["reference_aux"]
    metrics = report["ep1_metrics"]
    assert metrics["moe/load_balancing_loss"] == pytest.approx(mean, rel=1e-5)
    assert metrics["loss/moe_aux"] == pytest.approx(term, rel=1e-5)


@pytest.mark.parametrize("layout", ["ep2", "tp2_sp", "pp2", "tp2_etp1_ep2"])
def test_layouts_agree_without_the_load_balancing_term(report, layout):
    _same(report["no_aux"][layout])


def test_whole_experts_under_tp2_sync_to_rank_0_and_the_engine_agrees(report):
    """At TP = 2, expert TP 1, EP = 2 each rank holds two whole experts: the sync gathers
    the attention shards over TP and sends rank 1's experts to rank 0; the engine fed
    that sync scores like the actor."""
    sync, engine = report["etp1"]["first_rank_sync"], report["etp1"]["engine"]
    assert any(".mlp.experts.3.down_proj." in n for n in sync["names"]) and sync["diff"] <= TOL, sync["diff"]
    assert engine["tokens"] == 32 and engine["max_abs_dlogp"] <= 1e-3, engine


def test_a_weight_sync_at_pp2_sends_the_second_stages_experts_to_rank_0(report):
    sync = report["pp2_sync"]
    assert any("layers.1.mlp.experts.3.down_proj." in n for n in sync["names"]) and sync["diff"] <= TOL, sync["diff"]


@pytest.mark.parametrize("layout", ["etp1_same", "etp1_at_tp1"])
def test_a_checkpoint_saved_with_whole_experts_under_tp2_resumes_like_not_stopping(report, layout):
    case = report["resume"][layout]
    assert case["loaded_optimizer"] is True
    assert case["loss"][0] == pytest.approx(case["loss"][1], rel=TOL)
    assert case["weights"] <= TOL, case


def test_no_router_loss_is_reported_when_its_coefficient_is_zero(report):
    assert report["no_aux"]["aux_metrics"] == {"loss/moe_aux": 0.0}


def test_data_parallel_ranks_with_fewer_microbatches_run_fillers_that_change_nothing(report):
    case = report["uneven"]
    (long, short) = case["microbatches"]  # rows per micro-batch on DP ranks 0 and 1; 0 is a filler
    assert 0 not in long and len(long) == len(short) and 0 in short, case["microbatches"]
    _same(case["ep2_vs_ep1"])


@pytest.mark.parametrize("sharding", ["fully_reshardable", "dp_reshardable"])
def test_a_checkpoint_saved_at_ep2_resumes_at_ep2_like_not_stopping(report, sharding):
    case = report["resume"][f"{sharding}_ep2"]
    assert case["loaded_optimizer"] is True
    assert case["loss"][0] == pytest.approx(case["loss"][1], rel=TOL)
    assert case["weights"] <= TOL, case


@pytest.mark.parametrize("sharding", ["fully_reshardable", "dp_reshardable"])
def test_at_ep1_it_resumes_the_weights_and_restarts_adam(report, sharding):
    """megatron keeps the expert parameters' Adam state in a second optimizer at EP > 1, so
    the state does not map onto EP = 1's one optimizer: weights, counters and schedule load,
    Adam starts fresh (a warning says why)."""
    case = report["resume"][f"{sharding}_ep1"]
    assert case["loaded_optimizer"] is False
    assert case["loss"][0] == pytest.approx(case["loss"][1], rel=TOL)  # the same weights before the step
    assert case["weights"] > 10 * TOL  # Adam restarted: another update


def test_a_full_recompute_reports_the_router_losses_and_updates_alike(report):
    """megatron runs a checkpointed layer's first pass without grad (no router losses) and
    adds them when the backward pass recomputes it: counted there, fillers included."""
    case = report["full_recompute"]
    _same(case)
    assert case["metrics"]["moe/load_balancing_loss"][0] > 1.0


# Routing replay (tests/helpers/routing_replay_cases.py): "engine" routes from a perturbed
# copy of the model, the reference transformers' Qwen3-MoE with its routers forced to them.


def test_replaying_the_actors_own_routes_changes_nothing(report):
    case = report["replay"]["own_routes"]
    assert case == {"logp": 0.0, "agreement": 1.0}


@pytest.mark.parametrize("layout", ["padded", "packed", "ep2", "tp2_sp", "pp2"])
def test_replayed_logprobs_equal_transformers_forced_to_the_same_experts(report, layout):
    replay = report["replay"]
    case = replay[layout]
    assert case["logp"] <= TOL, case
    # the share of the engine's choices the actor's routers made too, as transformers' own
    # routers did in the forced forward (integer counts: exactly)
    assert case["agreement"] == pytest.approx(replay["expected_agreement"], abs=1e-12)
    assert 0.5 < replay["expected_agreement"] < 0.95  # the routes differ on a real share of the choices
    if layout == "padded":
        assert case["unreplayed_logp"] > 0.1, case  # without replay the log-probs differ


def test_a_full_recompute_replays_the_routes_of_the_forward(report):
    case = report["replay"]["recompute"]
    assert case["loss"][0] == pytest.approx(case["loss"][1], rel=TOL)
    assert case["agreement"][0] == case["agreement"][1] == report["replay"]["expected_agreement"]
    assert case["weights"] <= TOL, case


def test_routes_that_do_not_fit_the_model_are_refused_naming_the_field(report):
    errors = report["replay"]["errors"]
    assert "routed_experts has 2 layers x top-1" in errors["top_1"], errors
    assert "routed_experts holds an expert outside [0, 4)" in errors["unknown_expert"], errors
