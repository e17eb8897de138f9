"""Tiny random Qwen2 checkpoints and a reference log-prob recomputation for the rollout tests.

Nothing is downloaded: models are built from a ``Qwen2Config`` and saved with
``save_pretrained``. ``BENCH_CONFIG`` is the ~0.8M-parameter model of
``benchmarks/rollout_pool.py``; ``TEST_CONFIG`` is smaller for fast tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

VOCAB = 128

TEST_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=256,
    tie_word_embeddings=True,
    rms_norm_eps=1e-6,
)

# ~0.80M parameters (hidden 128, 3 layers, FFN 512, vocab 512, tied embeddings).
BENCH_CONFIG = dict(
    hidden_size=128,
    intermediate_size=512,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=512,
    tie_word_embeddings=True,
    rms_norm_eps=1e-6,
)


# vLLM's CPU attention kernels need head_dim >= 32 (TEST_CONFIG's 16 is refused): 256 / 4 = 64.
# Weight scale 0.15: logits of a few units, peaked enough that samples differ by seed.
VLLM_MODEL = dict(hidden_size=256, intermediate_size=512, scale=0.15)


def vllm_engine_args() -> dict:
    """``VLLMEngine`` arguments of the vLLM tests: float32 weights and compute (so a
    float32 ``transformers`` forward is a reference for the engine's arithmetic), a small
    KV cache on CPU, a small memory share on a GPU."""
    args = dict(dtype="float32", max_model_len=256, enforce_eager=True)
    if torch.cuda.is_available():
        return {**args, "gpu_memory_utilization": 0.2}
    return {**args, "kv_cache_memory_bytes": 64 << 20}


def build_qwen2(seed: int, *, scale: float = 0.3, **overrides):
    """A float32 ``Qwen2ForCausalLM`` with random weights (``scale`` sets the logit spread).

    HF's default init (std 0.02) makes near-uniform next-token distributions; a larger
    scale gives peaked ones, so sampling tests see both likely and unlikely tokens.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(**{**TEST_CONFIG, **overrides})
    model = Qwen2ForCausalLM(config)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1.0 + 0.1 * noise if "norm" in name else scale * noise)
    return model.eval()


def save_qwen2(directory: Path, seed: int, **overrides) -> Path:
    """Save a random tiny Qwen2 (config + safetensors) into ``directory``."""
    build_qwen2(seed, **overrides).save_pretrained(directory)
    return Path(directory)


def hf_state(directory: Path) -> dict[str, torch.Tensor]:
    """The HF-named tensors of the checkpoint in ``directory`` (as an actor would yield them)."""
    from safetensors.torch import load_file

    return dict(load_file(str(Path(directory) / "model.safetensors")))


class StateSource:
    """A weight source (``weight_sync.meta.WeightSource``) over an HF state dict: what the
    actor's rank 0 streams in a sync."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self.state = state

    def metadata(self):
        from megatron_rl.weight_sync.meta import TensorMeta

        return [TensorMeta.of(n, t) for n, t in self.state.items()]

    def __iter__(self):
        return iter(self.state.items())


@torch.no_grad()
def reference_logprobs(model, prompt: Sequence[int], completion: Sequence[int], temperature: float) -> torch.Tensor:
    """``log_softmax(logits / T)`` of each completion token from one unpadded full forward.

    This is what the trainer computes as ``old_logp``: ``[len(completion)]`` float32.
    """
    ids = torch.tensor([list(prompt) + list(completion)])
    logits = model(input_ids=ids).logits[0].float()
    start = len(prompt) - 1
    step_logits = logits[start : start + len(completion)]
    logp = torch.log_softmax(step_logits / (temperature if temperature > 0 else 1.0), dim=-1)
    return logp.gather(-1, torch.tensor(list(completion))[:, None]).squeeze(-1)


# An architecture for actor -> engine sync tests (``ActorSpec.architecture``): untied, so
# the LM head travels as a tensor of its own.
ACTOR_HF_CONFIG = dict(
    model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=64, intermediate_size=128,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
    max_position_embeddings=64, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
    torch_dtype="float32",
)  # fmt: skip


def save_actor_hf(directory: Path, *, seed: int = 0, state_dict: dict[str, torch.Tensor] | None = None) -> Path:
    """Save an :data:`ACTOR_HF_CONFIG` model (HF's init at ``seed``, or ``state_dict``) to ``directory``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(**{k: v for k, v in ACTOR_HF_CONFIG.items() if k != "architectures"}))
    if state_dict is not None:
        model.load_state_dict(state_dict, strict=True)
    model.save_pretrained(str(directory))
    return Path(directory)
