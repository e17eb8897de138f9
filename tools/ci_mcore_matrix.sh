#!/usr/bin/env bash
# Run the unit and distributed tests that run megatron-core code (marker ``mcore``, set by
# tests/conftest.py from the tests' imports) against another megatron-core release.
#
#   bash tools/ci_mcore_matrix.sh [VERSION]        (default 0.19.2)
#
# `pip install -e ".[test]"` resolves megatron-core 0.16.1 (setup.py admits
# >=0.16.1,<0.20). This script checks a newer release without touching that environment:
# megatron-core VERSION is installed with `pip install --target` into its own folder,
# which PYTHONPATH puts ahead of the running python's site-packages ($PYTHON, default
# `python`; a venv or not), so every package but megatron-core is the environment's own
# (the CPU torch, Ray, transformers, the editable megatron_rl) and every process the tests
# start (torchrun ranks, Ray workers) inherits the shadowing. The script checks that
# `import megatron.core` loads VERSION from that folder and fails if not.
#
# megatron-core 0.17+ declares Requires-Python >=3.12, but its code runs on 3.11, and
# 3.11 is the Python with a CPU build of torch 2.13 here (the cp312 torch on PyPI is the
# multi-GB CUDA build): the install uses --ignore-requires-python, so on CPython 3.11
# this checks code that upstream declares for 3.12+ only.
# megatron-core 0.18+ also needs Triton to import, which it does not declare and the CPU
# torch does not bring (megatron_rl.actor.compat.versions.extra_requirements): installed into the
# folder unless the python has it (the test extra brings one, which is then kept).
#
# The folder is .mcore-VERSION/ (ignored by git through its own .gitignore;
# MCORE_MATRIX_DIR overrides the place) and is rebuilt on every run.
set -euo pipefail
cd "$(dirname "$0")/.."

version="${1:-0.19.2}"
base_python="${PYTHON:-python}"
target="${MCORE_MATRIX_DIR:-.mcore-$version}"

if ! [[ "$version" =~ ^[0-9]+\.[0-9]+\.[0-9]+([a-z]+[0-9]+)?$ ]]; then
    echo "ci_mcore_matrix: '$version' is not a megatron-core version (e.g. 0.19.2)" >&2
    exit 2
fi

start=$(date +%s)
echo "== megatron-core matrix: $version; base python: $("$base_python" --version 2>&1) ($(command -v "$base_python"))"
"$base_python" -c "import torch, megatron_rl; print('== base torch', torch.__version__)"

rm -rf "$target"
mkdir -p "$target"
printf '*\n' > "$target/.gitignore"
target="$(cd "$target" && pwd)"
py="$base_python"
export PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}"

"$py" -m pip install --quiet --no-deps --ignore-requires-python --target "$target" "megatron-core==$version"

# Undeclared requirements of this release that the base python lacks.
missing=$("$py" -c '
import importlib.util, re, sys
from megatron_rl.actor.compat.versions import extra_requirements
for req in extra_requirements(sys.argv[1]):
    if importlib.util.find_spec(re.split(r"[=<>!~ ]", req)[0]) is None:
        print(req)
' "$version")
if [[ -n "$missing" ]]; then
    echo "== megatron-core $version needs, undeclared and missing here: $missing"
    # shellcheck disable=SC2086  # one requirement per word
    "$py" -m pip install --quiet --no-deps --target "$target" $missing
fi

# Fail loudly unless python imports exactly the requested megatron-core from the folder.
"$py" - "$version" "$target" <<'EOF'
import importlib
import os
import re
import sys
import warnings

warnings.simplefilter("ignore")
import megatron.core
import torch
from packaging.version import Version

from megatron_rl.actor.compat import versions as mcore_compat

want, venv = sys.argv[1], os.path.realpath(sys.argv[2])
got, where = megatron.core.__version__, os.path.realpath(megatron.core.__file__)
extras = [importlib.import_module(re.split(r"[=<>!~ ]", r)[0]) for r in mcore_compat.extra_requirements(want)]
print(
    f"== megatron-core {got} from {where}; torch {torch.__version__}; python {sys.version.split()[0]}"
    + "".join(f"; {m.__name__} {m.__version__}" for m in extras)
)
# The wheels report a local version too (0.19.2+922e9b0): the public part must match.
if Version(got).public != Version(want).public or not where.startswith(venv + os.sep):
    sys.exit(f"ci_mcore_matrix: wanted megatron-core {want} from {venv}, got {got} from {where}")
if not mcore_compat.is_supported():
    sys.exit(f"ci_mcore_matrix: megatron-core {got} is outside megatron_rl's range {mcore_compat.SUPPORTED}")
EOF

# Only the files that hold such tests are collected: collecting every test module would
# import the others' dependencies too (vLLM's at the vLLM tests' module level), in each
# pytest worker, for tests the marker then drops.
mapfile -t files < <("$py" -c '
from pathlib import Path
from tests.import_graph import exercises_megatron
for tier in ("unit", "distributed"):
    for path in sorted(Path("tests", tier).glob("test_*.py")):
        if exercises_megatron(path.resolve()):
            print(path)
')
if (( ${#files[@]} == 0 )); then
    echo "ci_mcore_matrix: found no test file that runs megatron-core code (tests/import_graph.py)" >&2
    exit 1
fi
echo "== megatron-core $version: ${#files[@]} test files run megatron-core code"

status=0
# The GPU suite's tiny run with megatron-core 0.19.2 is tests/install/test_gpu_wheelhouse.py's
# (the wheelhouse's 0.19.2, under the GPU image's imports): not run a third time here.
"$py" -m pytest -n 2 -m "mcore and (unit or distributed)" -p no:cacheprovider "${files[@]}" \
    --deselect tests/unit/test_gpu_suite.py::test_every_case_reports_finite_numbers \
    --deselect tests/unit/test_gpu_suite.py::test_float32_actor_logprobs_match_a_float64_reference \
    --deselect tests/unit/test_gpu_suite.py::test_markdown_table_has_a_section_per_case \
    || status=$?
echo "== megatron-core $version: the unit and distributed tests that run megatron-core exited $status in $(( $(date +%s) - start )) s"
exit "$status"
