"""``python -m megatron_rl.config`` prints the field reference (``docs/config.md``)."""

from megatron_rl.config.run import config_reference

print(config_reference(), end="")
