"""Megatron side of the trainer: model build, train step, log-probs, checkpoints, CPU shim.

Modules: ``launch`` (process groups, seeds), ``model`` (GPTModel from a HF config),
``batch`` (ActorBatch, micro-batches), ``actor`` (MegatronActor), ``checkpoint``,
``weights`` (HF-named weights in and out), ``cpu_shim``. See docs/actor.md.

Kept free of imports on purpose: importing ``megatron_rl.actor`` must not pull in
megatron-core (seconds of import time) for code that only needs one submodule.
"""
