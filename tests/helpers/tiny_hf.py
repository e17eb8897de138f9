"""Tiny random HF causal LMs for conversion tests (built from configs; nothing is downloaded).

Every architecture variant the converter supports: hidden 64, 2 layers, vocab 250 (so
Megatron pads to 256 and TP=2 padding is exercised), fp32. All parameters are
randomized, including biases and norm weights that HF initializes to 0 / 1, so a
layout bug cannot hide behind a constant.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 250

COMMON = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    vocab_size=VOCAB,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
)

VARIANTS = {
    # GQA (2 groups of 2 query heads), separate lm_head, q/k/v biases.
    "qwen2_gqa": ("Qwen2Config", dict(num_key_value_heads=2, tie_word_embeddings=False, rope_theta=1_000_000.0)),
    # Plain multi-head attention, tied embeddings (no lm_head tensor in the file).
    "qwen2_tied": ("Qwen2Config", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    # q/k RMSNorm and head_dim (32) != hidden / heads (16).
    "qwen3": ("Qwen3Config", dict(num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)),
    "llama": ("LlamaConfig", dict(num_key_value_heads=2, tie_word_embeddings=False, rope_theta=500_000.0)),
}

_MOE = dict(num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)

MOE_VARIANTS = {
    # Every layer a mixture of 4 SwiGLU experts of width 32, top-2, weights renormalised.
    "qwen3_moe": ("Qwen3MoeConfig", dict(_MOE, norm_topk_prob=True, tie_word_embeddings=False)),
    # The same with the top-2 softmax weights used as they are, and tied embeddings.
    "qwen3_moe_tied": ("Qwen3MoeConfig", dict(_MOE, norm_topk_prob=False, tie_word_embeddings=True)),
}
"""Mixture-of-experts variants, kept apart from :data:`VARIANTS` (which the dense
conversion tests run through the converter); ``build_*`` take both."""


def build_config(variant: str, **overrides):
    """The transformers config of ``variant`` (see :data:`VARIANTS` and :data:`MOE_VARIANTS`)."""
    import transformers

    class_name, extra = (VARIANTS | MOE_VARIANTS)[variant]
    return getattr(transformers, class_name)(**{**COMMON, **extra, **overrides})


def build_model(variant: str, seed: int = 0):
    """A randomized fp32 ``*ForCausalLM`` of ``variant``."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(build_config(variant), dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name:
                param.copy_(1.0 + 0.2 * noise)
            else:
                param.copy_(0.1 * noise)
    return model.eval()


def save_model(variant: str, directory: Path, *, seed: int = 0, max_shard_size: str | None = None) -> Path:
    """Save a randomized ``variant`` (config, generation config, safetensors) into ``directory``."""
    model = build_model(variant, seed)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    return Path(directory)


def save_tokenizer(directory: Path) -> None:
    """Save a word-level tokenizer over :data:`VOCAB` tokens (tokenizer.json + tokenizer_config.json)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB - 1)} | {"<unk>": VOCAB - 1}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>").save_pretrained(directory)


def round_trip_through_units(adapter, cfg, hf: dict[str, torch.Tensor], *, padded_vocab_size: int = 256) -> dict:
    """Every tensor of ``hf`` through ``adapter``'s weight units, HF -> Megatron -> HF;
    checks the units cover each HF tensor once and each Megatron tensor has its unit's
    shape. Returns ``{mcore_name: Megatron tensor}`` and the restored HF tensors."""
    units = adapter.weight_units(cfg, padded_vocab_size=padded_vocab_size)
    covered = [name for unit in units for name in unit.hf_names]
    assert sorted(covered) == sorted(hf), "units must cover every HF tensor exactly once"
    mcore, restored = {}, {}
    for unit in units:
        full = adapter.hf_to_mcore(unit, {name: hf[name] for name in unit.hf_names})
        assert tuple(full.shape) == unit.mcore_shape, unit.mcore_name
        mcore[unit.mcore_name] = full
        restored.update(adapter.mcore_to_hf(unit, full))
    return mcore, restored
