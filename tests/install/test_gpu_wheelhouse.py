"""The GPU suite's wheelhouse: downloads (PyPI), stays under the size a device call carries,
and the tiny suite runs with it under the GPU image simulation (tools/gpu_wheelhouse.sh)."""

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1].parent


def test_wheelhouse_builds_fits_and_runs_the_tiny_suite():
    proc = subprocess.run(["bash", "tools/gpu_wheelhouse.sh"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    wheels = sorted((REPO / ".gpu_wheels").glob("*.whl"))
    assert [w.name.split("-")[0] for w in wheels] == ["megatron_core"] and "cp312" in wheels[0].name
    assert sum(w.stat().st_size for w in wheels) < 48 * 2**20
