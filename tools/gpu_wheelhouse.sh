#!/usr/bin/env bash
# Build .gpu_wheels/: the wheels benchmarks/gpu_suite.py needs that the GPU machine's image lacks.
#
# The GPU machine (one H100/H200, Python 3.12, torch 2.11 + CUDA 13, transformers 5.17,
# triton) has no network and no megatron-core, Ray, vLLM or Transformer Engine; only what
# travels with the command (64 MiB in all, the source tree included) can be added. The
# suite imports nothing of Ray/vLLM/wandb; what it needs beyond the image is megatron-core
# alone (0.19.2 requires only torch, numpy and packaging, all on the image; its einops,
# wandb, ... imports are optional). Extra requirement specifiers given as arguments are
# downloaded too.
#
#   bash tools/gpu_wheelhouse.sh                 # download, size check, image-simulation check
#   bash tools/gpu_wheelhouse.sh --no-check      # download and size check only
#   bash tools/gpu_wheelhouse.sh pyyaml==6.0.2   # ... plus more wheels
#
# The check runs `benchmarks/gpu_suite.py --tiny` on this machine's CPU with the wheels
# unpacked first on PYTHONPATH (so megatron-core is the wheelhouse's version) and every
# import of a package that is neither on the GPU image (IMAGE_PACKAGES below, as listed for
# the 'cuda' image on 2026-11-17) nor in the wheelhouse refused, as it would be there.
# Optional imports that were refused are listed; a hard one fails the run and this script.
# Set SUITE_PYTHON to run that check with another interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=.gpu_wheels
MAX_MIB=${GPU_WHEELS_MAX_MIB:-48}
PY=${PYTHON:-python3}
SUITE_PY=${SUITE_PYTHON:-$PY}
CHECK=1
EXTRA=()
for arg in "$@"; do
  case "$arg" in
    --no-check) CHECK=0 ;;
    -h|--help) sed -n "2,20p" "$0"; exit 0 ;;
    *) EXTRA+=("$arg") ;;
  esac
done
PACKAGES=("megatron-core==0.19.2" "${EXTRA[@]}")

rm -rf "$WHEELS"
mkdir -p "$WHEELS"
echo "== downloading ${PACKAGES[*]} for CPython 3.12 manylinux x86_64 into $WHEELS/"
"$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d "$WHEELS" "${PACKAGES[@]}"

echo "== contents"
"$PY" - "$WHEELS" "$MAX_MIB" <<'EOF'
import pathlib, subprocess, sys
wheels, max_mib = pathlib.Path(sys.argv[1]), float(sys.argv[2])
files = sorted(wheels.glob("*.whl"))
total = sum(f.stat().st_size for f in files)
for f in files:
    print(f"  {f.stat().st_size / 2**20:7.2f} MiB  {f.name}")
print(f"  {total / 2**20:7.2f} MiB  total ({len(files)} wheels; limit {max_mib:g} MiB)")
# What else travels: tracked + untracked-not-ignored files (the device tool's 64 MiB covers both).
try:
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], capture_output=True, check=True).stdout
    tree = sum(p.stat().st_size for p in map(pathlib.Path, names.decode().split("\0")) if p.is_file())
    print(f"  {tree / 2**20:7.2f} MiB  source tree that travels with it; {(tree + total) / 2**20:.2f} MiB of 64 MiB")
    if tree + total > 64 * 2**20:
        sys.exit("error: source tree + wheels exceed the 64 MiB a device call carries")
except (OSError, subprocess.CalledProcessError):
    pass
if total > max_mib * 2**20:
    sys.exit(f"error: the wheelhouse is {total / 2**20:.1f} MiB > {max_mib:g} MiB")
EOF

if [ "$CHECK" = 1 ]; then
  echo "== image-simulation check: benchmarks/gpu_suite.py --tiny with only the image's packages + $WHEELS"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  cat >"$tmp/image_sim.py" <<'EOF'
"""Run gpu_suite.py --tiny as on the GPU image: wheelhouse unpacked first on sys.path, any
other non-image, non-stdlib package refused at import."""
import atexit, glob, importlib.abc, importlib.metadata, os, re, runpy, sys, zipfile

repo, site, wheels = sys.argv[1], sys.argv[2], sys.argv[3]
# Packages of the GPU machine's 'cuda' image (as listed for it on 2026-11-17), plus pip's own.
IMAGE_PACKAGES = """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite
lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas
nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand
nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink
nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum
opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks
pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn
scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash
yarl zipp""".split()
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()  # noqa: E731
allowed = {norm(n) for n in IMAGE_PACKAGES}
for w in sorted(glob.glob(os.path.join(wheels, "*.whl"))):
    allowed.add(norm(os.path.basename(w).split("-")[0]))
    zipfile.ZipFile(w).extractall(site)  # what `pip install --target` does, minus the tag check
local_dirs = tuple(os.path.realpath(p) + os.sep for p in (repo, site))
dists = importlib.metadata.packages_distributions()
refused: dict[str, str] = {}

def importer_is_local() -> bool:
    """Whether the import statement being served is in the repo or the wheelhouse (the image's
    own packages import their own dependencies there, whatever the versions here need)."""
    f = sys._getframe(2)
    while f is not None and (f.f_code.co_filename.startswith("<frozen") or "importlib" in f.f_code.co_filename
                             or f.f_code.co_filename == __file__):
        f = f.f_back
    return f is not None and os.path.realpath(f.f_code.co_filename).startswith(local_dirs)

class ImageOnly(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in sys.stdlib_module_names or top.startswith("_") or top in sys.modules or name != top:
            return None
        if not importer_is_local():
            return None
        for finder in sys.meta_path:  # where would it come from?
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        origin = os.path.realpath(spec.origin or (list(spec.submodule_search_locations or [""])[0]))
        if origin.startswith(local_dirs) or spec.origin in ("built-in", "frozen"):
            return None
        owners = {norm(d) for d in dists.get(top, [])}
        if owners and owners & allowed:
            return None
        refused.setdefault(top, ",".join(sorted(owners)) or "?")
        raise ModuleNotFoundError(f"No module named {top!r} (not on the GPU image: simulated)", name=top)

sys.path[:0] = [site, repo]
sys.meta_path.insert(0, ImageOnly())
atexit.register(lambda: print("== imports refused (not on the image): "
                              + (", ".join(f"{k} ({v})" for k, v in sorted(refused.items())) or "none"), flush=True))
sys.argv = [os.path.join(repo, "benchmarks", "gpu_suite.py"), *sys.argv[4:]]
runpy.run_path(sys.argv[0], run_name="__main__")
EOF
  mkdir -p "$tmp/site" "$tmp/out"
  set +e
  PYTHONPATH= "$SUITE_PY" "$tmp/image_sim.py" "$PWD" "$tmp/site" "$WHEELS" --tiny --out "$tmp/out" \
    >"$tmp/log" 2>"$tmp/err"
  rc=$?
  set -e
  grep -E '^== imports refused' "$tmp/log" || true
  "$PY" - "$tmp/out/gpu_suite.jsonl" <<'EOF' || true
import json, sys
try:
    recs = [json.loads(l) for l in open(sys.argv[1])]
except OSError:
    sys.exit()
calib = next((r for r in recs if r["case"] == "calibration"), {})
print(f"   megatron-core {calib.get('megatron_core')}, torch {calib.get('torch')}, transformers {calib.get('transformers')}")
for r in recs:
    if r["case"] not in ("calibration", "summary"):
        print(f"   {r['case']:8s} {str(r.get('variant')):45s} {r['status']}" + (f": {r.get('error') or r.get('reason')}" if r["status"] != "ok" else ""))
EOF
  if [ "$rc" != 0 ]; then
    echo "error: the tiny suite failed under the image simulation (exit $rc); its stderr:" >&2
    tail -40 "$tmp/err" >&2
    exit 1
  fi
  echo "   tiny suite passed under the image simulation"
fi

cat <<'EOF'
== device command (carry .gpu_wheels; run from the repository root on the GPU machine):
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/gw .gpu_wheels/*.whl && PYTHONPATH=$PWD:/tmp/gw PYTHONUNBUFFERED=1 python3 benchmarks/gpu_suite.py --out $OUT
EOF
