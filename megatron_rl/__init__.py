"""megatron_rl: Megatron-core RL post-training (GRPO family) with token-weighted policy losses.

Heavy dependencies (megatron-core, Ray, transformers) are imported by the subpackages
that need them, never here, so ``import megatron_rl`` and ``megatron-rl --help`` stay fast.
"""

__version__ = "0.1.0"
