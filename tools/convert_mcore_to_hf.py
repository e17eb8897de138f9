#!/usr/bin/env python
"""megatron-core dist-checkpoint -> HF safetensors; same as ``megatron-rl convert mcore-to-hf``.

    python tools/convert_mcore_to_hf.py --mcore runs/x/checkpoints/step_300 --out /ckpt/q7b-rl [--hf-config DIR]
"""

import argparse
import sys

from megatron_rl.cli import convert


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    convert.add_mcore_to_hf_arguments(parser)
    args = parser.parse_args(argv)
    args.convert_direction = "mcore-to-hf"
    return convert.run(args)


if __name__ == "__main__":
    sys.exit(main())
