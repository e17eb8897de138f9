#!/usr/bin/env python
"""HF safetensors -> megatron-core dist-checkpoint; same as ``megatron-rl convert hf-to-mcore``.

    python tools/convert_hf_to_mcore.py --hf /ckpt/Qwen2.5-7B-Instruct --out /ckpt/q7b-mcore --tp 4 --pp 1
"""

import argparse
import sys

from megatron_rl.cli import convert


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    convert.add_hf_to_mcore_arguments(parser)
    args = parser.parse_args(argv)
    args.convert_direction = "hf-to-mcore"
    return convert.run(args)


if __name__ == "__main__":
    sys.exit(main())
