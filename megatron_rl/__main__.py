"""``python -m megatron_rl`` is the ``megatron-rl`` command."""

import sys

from megatron_rl.cli import main

if __name__ == "__main__":
    sys.exit(main())
