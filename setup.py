"""Packaging for megatron_rl.

torch is pinned exactly: any range that admits a newer release lets pip resolve a
CUDA build with several GB of NVIDIA packages on a CPU machine. megatron-core 0.16.1
through 0.19.x are supported (CI runs the CPU tiers against 0.16.1 and 0.19.2; API
differences live in ``megatron_rl/actor/compat/versions.py``); pip on CPython 3.11 resolves 0.16.1,
since 0.17+ declare Python >= 3.12.
"""

from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent

# Versions this project is built and tested against (CPU CI and the GPU notes in
# docs/benchmarks.md). Upper bounds stop a silent major-version drift.
INSTALL_REQUIRES = [
    "torch==2.13.0",
    "megatron-core>=0.16.1,<0.20",
    "psutil>=5.9",  # megatron dist-checkpointing needs it but does not declare it
    "numpy>=1.26",
    "ray>=2.60,<2.61",
    # One range that vllm-cpu 0.32 (CPU) and vllm 0.32 (CUDA, the gpu extra) both accept.
    "transformers>=5.16.1,<5.20",
    "safetensors>=0.8,<0.9",
    "tokenizers>=0.23,<0.24",
    "pyyaml>=6.0",
    "wandb>=0.31,<0.32",
    "rich>=13",
    "math-verify>=0.9,<0.10",
    "matplotlib>=3.9,<4",  # tools/plot_run.py (Agg backend, no display)
    "pyarrow>=26,<27",  # .parquet datasets (megatron_rl.data.loaders)
    "scipy>=1.11,<2",  # Welch's t-test of a sweep's methods (megatron_rl.observability.comparison)
    # FP8 rollout weights (weight_sync.fp8); pure Python, installs on CPU machines too.
    "nvidia-modelopt>=0.47,<0.48",
]

EXTRAS_REQUIRE = {
    # CUDA 13 machines, CPython 3.12 (megatron-core 0.17+ need it): install with
    # `-c requirements/gpu-constraints.txt`, the known-good set tools/lock_gpu_constraints.py
    # resolves and CI re-checks (docs/install.md). vLLM on CPU: tools/install_vllm_cpu.sh.
    "gpu": [
        "vllm>=0.32,<0.33",  # requires torch==2.13.0, the pin above
        # transformer_engine_torch (the pytorch extra) is an sdist built against the
        # installed torch: pip install --no-build-isolation on a machine with the CUDA toolkit
        "transformer-engine[core_cu13,pytorch]>=2.20,<2.21",
        "megatron-core>=0.19.2,<0.20",
    ],
    "test": [
        "pytest>=8",
        "pytest-timeout>=2.3",
        # Two test workers (README: pytest -n 2): the tests mostly wait on processes they start,
        # which left the second core of a 2-core machine idle a third of the time.
        "pytest-xdist>=3.6,<4",
        "hypothesis>=6.100",
        # The fused loss's Triton kernels run under Triton's interpreter on CPU machines
        # (tests/unit/test_triton_kernels.py); CUDA torch wheels bring their own Triton.
        "triton>=3.4,<4",
        # A LoRA checkpoint's PEFT export is loaded by peft itself (tests/distributed/test_lora.py).
        "peft>=0.21,<0.22",
    ],
}

setup(
    name="megatron_rl",
    version="0.1.0",
    description=(
        "Megatron-core RL post-training (GRPO family) with token-weighted policy losses "
        "fused into the vocab-parallel cross-entropy."
    ),
    long_description=(HERE / "README.md").read_text(encoding="utf-8") if (HERE / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_rl", "megatron_rl.*"]),
    include_package_data=True,
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
    entry_points={
        "console_scripts": ["megatron-rl=megatron_rl.cli:main"],
        # Loaded by vLLM in each of its processes: registers the gloo weight-transfer backend.
        "vllm.general_plugins": ["megatron_rl_weight_transfer=megatron_rl.weight_sync.transports.vllm:register"],
    },
    license="Apache-2.0",
)
