"""Megatron side of the trainer: model build, train step, log-probs, checkpoints, CPU shim.

Kept free of imports on purpose: importing ``megatron_rl.actor`` must not pull in
megatron-core (seconds of import time) for code that only needs one submodule.
"""
