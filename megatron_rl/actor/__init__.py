"""The Megatron actor: model build, train step, log-probs, the frozen reference, checkpoints.

Modules: ``launch`` (process groups, seeds), ``model`` and ``spec`` (GPTModel from a HF
config), ``batch`` (ActorBatch, micro-batches, packing), ``policy`` and ``actor``
(MegatronActor: forward, loss, log-probs), ``update`` (one RL step's passes and
mini-batches), ``optimizer``, ``reference`` (the frozen reference policy), ``weights``
(HF-named weights out of and into the shards), ``worker`` and ``group`` (the ranks as Ray actors, driven as one),
``checkpoint/`` and ``compat/`` (megatron-core versions, the CPU shim). See docs/actor.md.

May import ``algo``, ``ops``, ``models``, ``config``, ``observability``, ``cluster``,
``weight_sync`` (the sending side) and ``storage``; never ``rollout``.
Kept free of imports on purpose: importing ``megatron_rl.actor`` must not pull in
megatron-core (seconds of import time) for code that only needs one submodule.
"""
