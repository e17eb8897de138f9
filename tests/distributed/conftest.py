"""Fixtures shared by the distributed tier's modules."""

import pytest

from tests.helpers.actor_job import REPO, run_actor_job

ACTOR_WORKER = REPO / "tests" / "helpers" / "actor_worker.py"
ACTOR_VARIANTS = ("qwen2_gqa", "qwen2_tied", "qwen3", "llama")


@pytest.fixture(scope="session")
def actor_job(tmp_path_factory) -> dict:
    """The 4-rank actor job (tests/helpers/actor_worker.py) on tiny HF models, run once:
    test_actor.py reads its full-parameter checks, test_lora.py its LoRA ones."""
    root = tmp_path_factory.mktemp("actor")
    reports, spec, out = run_actor_job(ACTOR_WORKER, ACTOR_VARIANTS, root, timeout_s=600)
    print(f"actor worker: {reports[0]['timing_s']}")
    return {"reports": reports, "r0": reports[0], "root": root, "out": out, "spec": spec}
