"""``megatron_rl.rollout`` imports lazily: no Ray, transformers or vLLM until they are needed."""

import ast
import subprocess
import sys


def _heavy_modules_after(statement: str) -> list[str]:
    code = (
        f"import sys; {statement}; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'ray', 'transformers', 'vllm', 'megatron'}))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return ast.literal_eval(proc.stdout.strip().splitlines()[-1])


def test_package_and_engine_modules_import_no_backend():
    # The vLLM engine module must import on a CPU machine without vLLM; so must the package.
    statement = "import megatron_rl.rollout, megatron_rl.rollout.engines.vllm, megatron_rl.algo.mismatch"
    assert _heavy_modules_after(statement) == []
