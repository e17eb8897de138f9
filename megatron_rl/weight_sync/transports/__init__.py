"""How a weight version's bytes move from actor rank 0 to the engines, one module per
transfer backend: ``gloo`` (chunked broadcasts over a gloo group, host memory), ``shm``
(a host shared-memory file the engines map), ``vllm`` (vLLM's ``nccl``/``ipc`` trainer
engines and the ``megatron_rl_gloo`` backend registered with vLLM; imported only where
vLLM is installed). The object store needs no module: buckets go through ``ray.put``.
"""
