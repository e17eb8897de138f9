"""FP8 rollout weights (``weight_sync.fp8``): the block-wise e4m3 format's error bound,
its wire layout, pairing on the receiver, and the built-in engine loading it."""

import math

import pytest
import torch

from megatron_rl.config.lib import ConfigError
from megatron_rl.weight_sync.fp8 import (
    BLOCK,
    Dequantizer,
    Fp8Source,
    dequantize,
    is_quantized,
    quantize,
    scale_name,
    wire_metas,
)
from megatron_rl.weight_sync.meta import TensorMeta, WeightUpdateError


def _weights():
    gen = torch.Generator().manual_seed(0)
    normal = torch.randn(300, 200, generator=gen) * 0.02
    ranged = torch.randn(256, 384, generator=gen) * torch.logspace(-6, 2, 384)  # 8 decades across columns
    zero_block = torch.randn(256, 256, generator=gen)
    zero_block[:128, 128:] = 0
    return {"normal": normal, "ranged": ranged, "zero_block": zero_block, "small": torch.randn(5, 7, generator=gen)}


@pytest.mark.parametrize("key", ["normal", "ranged", "zero_block", "small"])
def test_round_trip_is_within_e4m3_bound(key):
    w = _weights()[key]
    q, scale_inv = quantize(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scale_inv.dtype == torch.float32
    assert tuple(scale_inv.shape) == (math.ceil(w.shape[0] / BLOCK), math.ceil(w.shape[1] / BLOCK))
    assert torch.isfinite(scale_inv).all() and (scale_inv > 0).all()
    back = dequantize(q, scale_inv, torch.float32)
    err = (back - w).abs()
    # per tensor: 3 mantissa bits -> at most 2^-4 of the largest magnitude
    assert err.max() <= 2**-4 * w.abs().max()
    # per element: 2^-4 relative in e4m3's normal range, 2^-10 of the block scale below it
    scale = scale_inv.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[: w.shape[0], : w.shape[1]]
    assert (err <= torch.maximum(2**-4 * w.abs(), 2**-10 * scale) * (1 + 1e-6)).all()
    if key == "zero_block":
        assert (back[:128, 128:] == 0).all()
    assert err.max() > 0  # FP8 is lossy: the test would notice a format that silently stayed float32


def test_wire_layout_quantizes_projection_weights_only():
    metas = [
        TensorMeta("model.embed_tokens.weight", "bfloat16", (1000, 256)),
        TensorMeta("model.layers.0.self_attn.q_proj.weight", "bfloat16", (256, 256)),
        TensorMeta("model.layers.0.self_attn.q_proj.bias", "bfloat16", (256,)),
        TensorMeta("model.layers.0.mlp.down_proj.weight", "bfloat16", (256, 300)),
        TensorMeta("model.layers.0.input_layernorm.weight", "bfloat16", (256,)),
        TensorMeta("lm_head.weight", "bfloat16", (1000, 256)),
    ]
    wire = {m.name: m for m in wire_metas(metas)}
    assert wire["model.layers.0.self_attn.q_proj.weight"].dtype == "float8_e4m3fn"
    assert wire[scale_name("model.layers.0.mlp.down_proj.weight")] == TensorMeta(
        "model.layers.0.mlp.down_proj.weight_scale_inv", "float32", (2, 3)
    )
    for plain in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.self_attn.q_proj.bias",
                  "model.layers.0.input_layernorm.weight"):  # fmt: skip
        assert wire[plain].dtype == "bfloat16" and not is_quantized(plain, wire[plain].shape)
    assert len(wire) == len(metas) + 2


def test_dequantizer_pairs_weights_and_scales_across_chunks_in_any_order():
    w = {"a.q_proj.weight": torch.randn(130, 64), "a.k_proj.weight": torch.randn(64, 64)}

    class Source(list):
        def metadata(self):
            return [TensorMeta.of(n, t) for n, t in self]

    wire = list(Fp8Source(Source(list(w.items()) + [("norm.weight", torch.ones(64))])))
    assert [n for n, _ in wire] == ["a.q_proj.weight", "a.q_proj.weight_scale_inv", "a.k_proj.weight",
                                    "a.k_proj.weight_scale_inv", "norm.weight"]  # fmt: skip
    deq = Dequantizer(torch.float32)
    # scales first for one weight, each tensor in a chunk of its own
    order = [wire[1], wire[0], wire[4], wire[2], wire[3]]
    out = {}
    for item in order:
        out.update(deq.feed([item]))
    deq.finish()
    assert sorted(out) == ["a.k_proj.weight", "a.q_proj.weight", "norm.weight"]
    for name, tensor in w.items():
        assert (out[name] - tensor).abs().max() <= 2**-4 * tensor.abs().max()
    deq.feed([wire[0]])
    with pytest.raises(WeightUpdateError, match="lacking their pair.*a.q_proj.weight"):
        deq.finish()


def test_hf_engine_loads_fp8_updates_and_refuses_plain_ones(tmp_path):
    from megatron_rl.rollout.engines.hf import HFEngine
    from tests.helpers.rollout_models import hf_state, save_qwen2

    directory = save_qwen2(tmp_path / "m", seed=0)
    state = hf_state(directory)
    engine = HFEngine(directory)
    engine.set_weight_format("fp8")
    assert engine.health()["weight_format"] == "fp8"
    name = "model.layers.0.mlp.up_proj.weight"
    with pytest.raises(WeightUpdateError, match=r"_proj\.weight' is float32; the engine loads float8_e4m3fn"):
        engine.begin_weight_update(1, [TensorMeta.of(n, t) for n, t in state.items()])
    engine.update_weights(state.items(), version=1)
    assert engine.weight_version == 1
    loaded = engine.model.state_dict()
    q, s = quantize(state[name])
    assert torch.equal(loaded[name], dequantize(q, s, torch.float32))
    assert not torch.equal(loaded[name], state[name])
    assert torch.equal(loaded["model.norm.weight"], state["model.norm.weight"])


def test_fp8_needs_an_engine_that_reads_it():
    from megatron_rl.config.rollout import RolloutConfig
    from megatron_rl.rollout.pool.worker import engine_class
    from megatron_rl.weight_sync.sync import resolve_transport

    transport = resolve_transport(RolloutConfig(weight_dtype="fp8"), engine_class("hf"), cuda=False)
    assert transport == ("shared_memory", "object_store")
    with pytest.raises(ConfigError, match="rollout.weight_dtype"):
        resolve_transport(RolloutConfig(engine="vllm", weight_dtype="fp8"), engine_class("vllm"), cuda=False)
