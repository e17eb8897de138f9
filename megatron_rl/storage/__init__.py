"""What a run keeps on disk, made safe: durable atomic writes (``durable``) and checkpoint
directories as files (``checkpoints``: the integrity manifest, the ``latest`` pointer, the
checkpoint to resume from).

Standard library only, the lowest layer with ``config.lib``: the actor's checkpoint code,
the metrics sink and the loop's pre-flight import it; it imports nothing of megatron_rl.
"""
