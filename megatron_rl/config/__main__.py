"""``python -m megatron_rl.config [sft]`` prints the field reference of an RL run
(``docs/config.md``) or of an SFT run (``docs/sft_config.md``)."""

import sys

from megatron_rl.config.run import config_reference
from megatron_rl.config.sft import sft_config_reference

print(sft_config_reference() if sys.argv[1:] == ["sft"] else config_reference(), end="")
