"""Engines run as a pool: ``pool`` (Ray actors: dispatch, retries, restarts, sleep/wake),
``weights`` (the pool's half that brings weight versions into the engines, LoRA adapters
included), ``dispatch`` (how a call is split into requests), ``worker`` (one engine inside
its Ray actor; ``engine_class`` resolves ``rollout.engine``), ``client`` (the engines as a
weight-sync client, restart waiting, errors) and ``local`` (one engine in the driver's
process: ``rollout.engine_process: driver``).
"""
