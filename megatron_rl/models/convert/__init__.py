"""HF safetensors <-> megatron-core dist-checkpoints, streaming one tensor at a time:
``hf_mcore`` (:func:`hf_to_mcore`, :func:`mcore_to_hf`, their options) and ``mcore_io``
(the Megatron side's reader and writer). ``megatron-rl convert`` is the command line.
"""
