"""``megatron_rl.actor.compat.versions`` takes the branch of the megatron-core that is installed.

Run under each megatron-core of the matrix (0.16.1 here, 0.19.2 by
``tools/ci_mcore_matrix.sh``): the checks hold for whichever is installed, with real
megatron-core objects, no mocks.
"""

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from megatron_rl.actor.compat import versions as mcore_compat

ROOT = Path(__file__).resolve().parents[2]


def test_version_is_the_imported_megatron_core_and_supported():
    import megatron.core

    assert mcore_compat.mcore_version() == Version(megatron.core.__version__)
    assert mcore_compat.is_supported(), f"megatron-core {megatron.core.__version__} is outside {mcore_compat.SUPPORTED}"


def test_supported_range_is_the_setup_py_pin():
    pin = re.search(r'"megatron-core([^"]*)"', (ROOT / "setup.py").read_text())
    assert pin is not None, "setup.py pins no megatron-core"
    assert mcore_compat.SUPPORTED == SpecifierSet(pin.group(1))


@pytest.mark.parametrize(
    ("version", "expected"),
    [("0.16.1", ()), ("0.17.1", ()), ("0.18.0", ("triton",)), ("0.19.2", ("triton",)), ("0.19.0rc1", ("triton",))],
)
def test_extra_requirements_by_version(version, expected):
    names = tuple(re.split(r"[=<>!~ ]", req)[0] for req in mcore_compat.extra_requirements(version))
    assert names == expected


def test_extra_requirements_of_the_installed_release_are_importable():
    """megatron-core imported above, so what it needs besides its declared dependencies is there."""
    import importlib

    for req in mcore_compat.extra_requirements(mcore_compat.mcore_version()):
        importlib.import_module(re.split(r"[=<>!~ ]", req)[0])


def test_at_least_compares_release_numbers():
    assert mcore_compat.at_least("0.19.0", installed="0.19.2")
    assert mcore_compat.at_least("0.19.0", installed="0.19.0rc3")  # a pre-release counts as its release
    assert not mcore_compat.at_least("0.19.0", installed="0.18.2")
    assert mcore_compat.is_supported("0.16.1") and mcore_compat.is_supported("0.19.2")
    assert not mcore_compat.is_supported("0.16.0") and not mcore_compat.is_supported("0.20.0")


# A 1-rank gloo job: the CPU shim (its stream stand-in included), a tiny GPTModel in megatron
# DDP, one backward pass and DDP's gradient sync, which on 0.19+ asks for the CUDA stream.
_DDP_SYNC = textwrap.dedent(
    """
    import torch, torch.distributed as dist
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    from megatron_rl.actor.compat import versions as mcore_compat
    from megatron_rl.actor.compat import cpu_shim
    from megatron_rl.actor.launch import initialize_parallel
    initialize_parallel()
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2,
                               **cpu_shim.transformer_config_overrides())
    with cpu_shim.cuda_to_cpu():
        model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                         vocab_size=32, max_sequence_length=8)
        ddp = DistributedDataParallel(
            config=config,
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False),
            module=model)
        ids = torch.randint(0, 32, (2, 8))
        pos = torch.arange(8).expand(2, 8)
        mask = torch.ones(8, 8, dtype=torch.bool).triu(1)[None, None]
        ddp(ids, pos, mask).float().square().mean().backward()
        ddp.finish_grad_sync()
    grads = [p.main_grad for p in model.parameters()]
    assert all(torch.isfinite(g).all() for g in grads) and any(g.abs().sum() > 0 for g in grads)
    stream = torch.cuda.current_stream()
    assert stream is torch.cuda.Stream() and stream.wait_stream(stream) is None and stream.query() is True
    assert isinstance(torch.cuda.Stream | None, object)  # a class: transformers' annotations evaluate this
    with torch.cuda.stream(stream):
        pass
    # Every group goes before exit, the model's references too (destroy_process_groups).
    del ddp, model, grads
    from megatron_rl.actor.launch import destroy_process_groups
    destroy_process_groups()
    import os
    loops = [t for t in os.listdir("/proc/self/task")
             if open(f"/proc/self/task/{t}/comm").read().strip() == "gloo_tcp_loop"]
    assert len(loops) <= 1, f"{len(loops)} gloo groups outlive the teardown"
    print("OK", mcore_compat.mcore_version())
    """
)


def test_ddp_gradient_sync_runs_on_cpu_with_the_shim():
    if torch.cuda.is_available():
        pytest.skip("the CPU shim is a no-op with CUDA")
    proc = subprocess.run(
        [sys.executable, "-c", _DDP_SYNC],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    assert f"OK {mcore_compat.mcore_version()}" in proc.stdout


def test_suspended_steps_out_of_the_shims_mode_and_back():
    """``cpu_shim.suspended(mode)``: the body runs without the mode (a ``"cuda"`` factory
    call fails on a CPU-only torch, as in the model code it is for), the mode is back after
    it, also after an exception; ``None`` (CUDA) does nothing."""
    if torch.cuda.is_available():
        pytest.skip("the CPU shim's mode is a no-op with CUDA")
    from megatron_rl.actor.compat import cpu_shim

    with cpu_shim.cuda_to_cpu() as mode:
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        with cpu_shim.suspended(mode):
            with pytest.raises((AssertionError, RuntimeError)):
                torch.zeros(2, device="cuda")
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        with pytest.raises(KeyError), cpu_shim.suspended(mode):
            raise KeyError("body")
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        with cpu_shim.suspended(None):
            assert torch.zeros(2, device="cuda").device.type == "cpu"
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(2, device="cuda")
