"""Actor checkpoints: megatron ``dist_checkpointing`` of model and optimizer, plus RNG
states, counters and the driver's state, written atomically (``save_load``).

The files' integrity (manifest, ``latest``, the checkpoint to resume from) is checked on
the driver without loading anything, by :mod:`megatron_rl.storage.checkpoints`.
Imports nothing here, so the driver can name the package without pulling in megatron-core.
"""
