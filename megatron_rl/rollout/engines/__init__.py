"""Generation engines: ``base`` (the sampling parameters, completions and the
:class:`~megatron_rl.rollout.engines.base.RolloutEngine` contract every engine keeps),
``hf`` (the built-in ``transformers`` engine, CPU or GPU; ``sampling`` its sampler) and
``vllm`` (``vllm.LLM``; the real vLLM CPU build in CI).

May import ``config``, ``models`` and ``weight_sync`` (the receiving side of an update).
"""
