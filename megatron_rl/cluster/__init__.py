"""Where a run's processes go and whether they fit: ``placement`` (every Ray placement
decision: the GPU plan, placement groups per node, CPU placement, ``placement.json``) and
``planner`` (predicted memory per GPU and component: ``megatron-rl plan``); ``processes``
(whether a process seen earlier still runs: pid and start time).

May import ``config``, ``models`` (architecture sizes) and ``ops`` (the fused loss's
chunking); imported by ``actor``, ``rollout``, ``loop`` and ``cli``.
"""
