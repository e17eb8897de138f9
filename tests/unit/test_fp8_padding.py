"""FP8 padding follows the recipe: megatron-core's GEMM alignment (32 for MXFP8, whose
scales cover blocks of 32 elements; 16 otherwise), and a configured multiple that breaks it
is a ConfigError naming the field before anything starts."""

from pathlib import Path

import pytest

from megatron_rl.actor.policy import pad_multiple
from megatron_rl.actor.spec import ActorSpec
from megatron_rl.config.lib import ConfigError
from megatron_rl.config.model import ModelOptions
from megatron_rl.config.parallel import ParallelConfig
from megatron_rl.config.run import FP8_ALIGN_TOKENS, load_run_config
from megatron_rl.config.trainer import ActorConfig

fp8_utils = pytest.importorskip("megatron.core.fp8_utils")
from megatron.core.enums import Fp8Recipe  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu.yaml"


def _spec(*, fp8=None, recipe="delayed", multiple=None, tp=1, sp=False):
    return ActorSpec(
        architecture={},
        model=ModelOptions(fp8=fp8, fp8_recipe=recipe),
        parallel=ParallelConfig(num_actor_ranks=tp, tensor_model_parallel_size=tp, sequence_parallel=sp),
        actor=ActorConfig(pad_tokens_to_multiple_of=multiple),
    )


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "mxfp8", "blockwise"])
def test_the_config_layer_table_is_megatrons_rule(recipe):
    assert FP8_ALIGN_TOKENS.get(recipe, 16) == fp8_utils.get_fp8_align_size(Fp8Recipe(recipe))


@pytest.mark.parametrize(("recipe", "want"), [("delayed", 16), ("tensorwise", 16), ("blockwise", 16), ("mxfp8", 32)])
def test_fp8_pads_to_the_recipes_alignment(recipe, want):
    assert pad_multiple(_spec(fp8="e4m3", recipe=recipe), use_te=True) == want


def test_without_fp8_te_pads_to_16_and_the_local_spec_not_at_all():
    assert pad_multiple(_spec(), use_te=True) == 16
    assert pad_multiple(_spec(), use_te=False) == 1


def test_sequence_parallel_takes_the_lcm_with_tp():
    assert pad_multiple(_spec(fp8="e4m3", recipe="mxfp8", tp=3, sp=True), use_te=True) == 96
    assert pad_multiple(_spec(multiple=8, tp=4, sp=True), use_te=False) == 8


def test_a_multiple_that_breaks_the_recipes_alignment_is_a_config_error(tmp_path):
    base = [f"trainer.output_dir={tmp_path}", "model.fp8=e4m3", "model.fp8_recipe=mxfp8"]
    with pytest.raises(ConfigError, match="actor.pad_tokens_to_multiple_of") as info:
        load_run_config(EXAMPLE, [*base, "actor.pad_tokens_to_multiple_of=16"])
    assert "32" in str(info.value)
    assert load_run_config(EXAMPLE, [*base, "actor.pad_tokens_to_multiple_of=64"]).actor.pad_tokens_to_multiple_of == 64
