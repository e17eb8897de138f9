"""Where a run's processes go and whether they fit: ``placement`` (every Ray placement
decision: the GPU plan, placement groups per node, CPU placement, ``placement.json``) and
``planner`` (predicted memory per GPU and component: ``megatron-rl plan``); ``processes``
(whether a process seen earlier still runs: pid and start time); ``local_ray`` (a Ray
cluster of this process's own, started again when its node does not come up).

May import ``config``, ``models`` (architecture sizes) and ``ops`` (the fused loss's
chunking); imported by ``actor``, ``rollout``, ``loop`` and ``cli``.
"""
