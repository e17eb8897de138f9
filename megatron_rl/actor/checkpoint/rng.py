"""Every RNG state of an actor rank, saved with a checkpoint (``rng/rank<r>.pt``) and
restored on resume: Python, NumPy, torch and megatron's CUDA-RNG tracker, as tensors,
numbers and strings only (loaded with ``weights_only=True``).
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = ["load_rng_file", "rng_state", "set_rng_state"]


def rng_state() -> dict[str, Any]:
    """Every RNG state of this process as tensors, numbers and strings only, so that the file
    loads with ``torch.load(weights_only=True)``: nothing in a checkpoint is unpickled as code."""
    import numpy as np
    from megatron.core import tensor_parallel

    py_version, py_state, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_cached = np.random.get_state()
    state = {
        "python": {"version": py_version, "state": torch.tensor(py_state, dtype=torch.int64), "gauss_next": py_gauss},
        "numpy": {
            "name": str(np_name),
            "keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "cached_gaussian": float(np_cached),
        },
        "torch": torch.get_rng_state(),
        "tracker": {name: t.cpu() for name, t in tensor_parallel.get_cuda_rng_tracker().get_states().items()},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    import numpy as np
    from megatron.core import tensor_parallel

    py = state["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss_next"]))
    npy = state["numpy"]
    keys = npy["keys"].numpy().astype(np.uint32)
    np.random.set_state((npy["name"], keys, npy["pos"], npy["has_gauss"], npy["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(dict(state["tracker"]))


def load_rng_file(path: Path) -> dict[str, Any] | None:
    """The saved RNG state, read with ``weights_only=True``; ``None`` (with a warning) for a
    file that is not tensors and numbers only (written before this format, or crafted: a
    pickle that would run code when unpickled is refused, not run)."""
    try:
        saved = torch.load(path, weights_only=True, map_location="cpu")
        state = saved["state"]
        if not (isinstance(state.get("python"), Mapping) and isinstance(state.get("numpy"), Mapping)):
            raise ValueError("not the tensor RNG format")
        return state
    except Exception as e:  # UnpicklingError for a refused global, KeyError/TypeError/ValueError for old layouts
        warnings.warn(
            f"{path}: not a tensor-only RNG file, so it was not unpickled ({type(e).__name__}); "
            "the RNG streams continue from the seed",
            stacklevel=3,
        )
        return None
