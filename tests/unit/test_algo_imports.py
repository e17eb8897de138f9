"""``megatron_rl.algo`` is pure tensor math: importing it pulls in no Ray, Megatron or vLLM."""

import subprocess
import sys


def test_algo_imports_no_heavy_frameworks():
    code = (
        "import sys, megatron_rl.algo; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('ray', 'megatron', 'vllm', 'transformer_engine', 'transformers')); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
