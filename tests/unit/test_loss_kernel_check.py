"""``actor.loss_kernel`` is checked when the actor starts (``check_loss_kernel``), naming
the field, rather than failing at the first loss."""

import pytest
import torch

from megatron_rl.actor.policy import check_loss_kernel
from megatron_rl.config.lib import ConfigError


def test_triton_on_a_cpu_actor_names_the_field(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the test suite's interpreter mode
    with pytest.raises(ConfigError, match=r"actor\.loss_kernel.*needs CUDA tensors"):
        check_loss_kernel("triton", torch.device("cpu"), torch.bfloat16)


def test_triton_with_float64_weights_names_the_field():
    with pytest.raises(ConfigError, match=r"actor\.loss_kernel.*float64"):
        check_loss_kernel("triton", torch.device("cpu"), torch.float64)


@pytest.mark.parametrize("kernel", ["auto", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_auto_and_torch_run_anywhere(kernel, dtype, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    check_loss_kernel(kernel, torch.device("cpu"), dtype)


def test_unknown_kernel_names_the_field():
    with pytest.raises(ConfigError, match=r"actor\.loss_kernel.*must be one of"):
        check_loss_kernel("cuda", torch.device("cpu"), torch.float32)
