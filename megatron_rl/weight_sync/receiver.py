"""The receiving end of a weight sync: an engine's update state machine.

Every engine inherits :class:`WeightReceiver` (``rollout.engines.base.RolloutEngine``
does), so the contract's checks and state live here once, whatever the engine:

- **Weights are HF-named full tensors** (``model.layers.0.self_attn.q_proj.weight``), as
  ``save_pretrained`` writes them, in the dtype the engine loads
  (:meth:`~WeightReceiver.expected_weights`); the engine owns any re-layout (vLLM fuses
  q/k/v).
- **An update is one version, the whole model.** :meth:`~WeightReceiver.begin_weight_update`
  checks its metadata before anything moves (an unknown name, a wrong shape or dtype, a
  missing tensor raise :class:`~megatron_rl.weight_sync.meta.WeightUpdateError` naming the
  engine and the version, and the engine keeps its weights); the tensors then arrive as
  host tensors (:meth:`~WeightReceiver.load_weights`, once per bucket) or through a
  transfer group (:meth:`~WeightReceiver.init_weight_transfer` once,
  :meth:`~WeightReceiver.receive_weights`); :meth:`~WeightReceiver.commit_weight_update`
  makes the version current.
- **A failed update after data moved leaves mixed weights**: the engine reports
  ``ok: False`` and refuses to generate until a full update commits (the pool restarts it).
- Updates are allowed while an engine sleeps (a colocated sync wakes the weights alone).
- **An engine may start without weights**, from a directory with a config alone
  (:func:`has_weights`): it builds the architecture, reports version ``-1`` and
  ``ok: False``, and refuses to generate until its first update commits (the run syncs
  version 0 into it first; a restarted one is restored like any other).

Engines implement the hooks (``expected_weights``, ``_load_host`` and, to join a
transfer group, ``_join_transfer`` / ``_receive``; optionally ``_start_update`` /
``_finish_update``).
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from megatron_rl.weight_sync.buckets import WeightBucket, unpack_bucket
from megatron_rl.weight_sync.meta import TensorMeta, check_update, dtype_of

__all__ = ["WeightReceiver", "checkpoint_tensors", "has_weights"]


def has_weights(model_path: str | Path) -> bool:
    """Whether the HF directory ``model_path`` holds weights (safetensors), or only a config:
    an engine started from a config alone waits for its first update (see the module docstring)."""
    return any(Path(model_path).glob("*.safetensors"))


def checkpoint_tensors(model_path: str | Path, dtype: torch.dtype) -> dict[str, TensorMeta]:
    """``{HF name: TensorMeta}`` of every tensor a sync into an engine started from the HF
    directory ``model_path`` must carry, in ``dtype``: the checkpoint's tensors (read from
    the safetensors headers, no data), or, for a directory with a config alone, the
    architecture's (the model adapter's weight units). Tensors that hold no weights of
    their own (RoPE ``inv_freq`` buffers, a tied checkpoint's copy of the embedding) are left out."""
    from megatron_rl.models import ConversionError, adapter_for_config
    from megatron_rl.models.hf_io import SafetensorsReader, read_config

    config = read_config(Path(model_path))
    dtype_name = str(dtype).removeprefix("torch.")
    if not has_weights(model_path):
        adapter = adapter_for_config(config)  # ConversionError names the model type without an adapter
        units = adapter.weight_units(config, padded_vocab_size=int(config["vocab_size"]))
        return {n: TensorMeta(n, dtype_name, tuple(s)) for u in units for n, s in zip(u.hf_names, u.hf_shapes)}
    try:
        ignorable = adapter_for_config(config).ignorable_hf_names(config)
    except ConversionError:  # an architecture without an adapter: every tensor counts
        ignorable = lambda name: False  # noqa: E731
    return {
        name: TensorMeta(name, dtype_name if spec.dtype.is_floating_point else str(spec.dtype).removeprefix("torch."),
                         tuple(spec.shape))  # fmt: skip
        for name, spec in SafetensorsReader.open(Path(model_path)).entries.items()
        if not ignorable(name)
    }


class WeightReceiver(abc.ABC):
    """An engine's side of every weight update (see the module docstring)."""

    name: str = "engine"
    """Human-readable name used in errors."""

    # Class-level defaults stand in for state until first set.
    weight_backends: tuple[str, ...] = ("object_store",)
    """Transfer backends this engine receives through (``object_store``: host tensors via
    :meth:`load_weights`; ``gloo``, ``nccl``, ``ipc``: a sender's transfer group)."""

    _version: int = 0
    _update_version: int | None = None
    _update_touched: bool = False
    _weights_ok: bool = True
    _dequantizer: Any = None  # a ``weight_sync.fp8.Dequantizer`` while an FP8 update is open

    weight_formats: tuple[str, ...] = ("auto",)
    """Wire formats this engine reads (``rollout.weight_dtype``): ``auto`` (its own dtype)
    and, where supported, ``fp8`` (``weight_sync.fp8``)."""

    weight_format: str = "auto"
    """The wire format of this engine's updates (:meth:`set_weight_format`)."""

    def set_weight_format(self, fmt: str) -> None:
        """Receive updates in wire format ``fmt`` from now on (one of :attr:`weight_formats`)."""
        if fmt not in self.weight_formats:
            raise ValueError(f"{self.name}: weight format {fmt!r} is not one of {self.weight_formats}")
        self.weight_format = fmt

    def wire_weights(self) -> dict[str, TensorMeta]:
        """What an update carries on the wire: :meth:`expected_weights`, in FP8 form
        (each projection weight plus its block scales) when the format is ``fp8``."""
        if self.weight_format != "fp8":
            return self.expected_weights()
        from megatron_rl.weight_sync.fp8 import wire_metas

        return {m.name: m for m in wire_metas(self.expected_weights().values())}

    def _load_wire(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Load wire tensors: FP8 ones dequantized to the engine's dtype first."""
        if self._dequantizer is not None:
            named_tensors = self._dequantizer.feed(named_tensors)
        if named_tensors:
            self._load_host(named_tensors)

    @classmethod
    def weight_transfer_args(cls, backend: str) -> dict[str, Any]:
        """Extra constructor arguments an engine needs to receive through ``backend``
        (vLLM fixes its weight-transfer backend at start-up); default none."""
        return {}

    @property
    def weight_receivers(self) -> int:
        """Processes of this engine that join a transfer group (vLLM: one per worker)."""
        return 1

    @abc.abstractmethod
    def expected_weights(self) -> dict[str, TensorMeta]:
        """``{HF name: TensorMeta}`` of every tensor a weight update carries, in the dtype
        the engine loads (a sync sends exactly these)."""

    @abc.abstractmethod
    def _load_host(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Load host tensors of the open update (names and shapes already checked)."""

    def _start_update(self) -> None:  # noqa: B027  (optional hook)
        """Prepare the model for an update (vLLM: layerwise reload)."""

    def _finish_update(self, version: int | None) -> None:  # noqa: B027  (optional hook)
        """Complete the update (vLLM: rebuild the layers that received tensors); ``None``
        when it is aborted."""

    def _join_transfer(self, init_info: dict[str, Any]) -> None:
        raise NotImplementedError(f"{self.name} cannot join a weight-transfer group (backends {self.weight_backends})")

    def _receive(self, update_info: dict[str, Any]) -> None:
        raise NotImplementedError(f"{self.name} cannot receive from a weight-transfer group")

    @property
    def weight_version(self) -> int:
        """Version of the weights now loaded (0 = the initial checkpoint; -1: none yet)."""
        return self._version

    @property
    def weight_dtype(self) -> str:
        """The dtype the engine loads its floating-point weights in (``"bfloat16"``)."""
        return next((m.dtype for m in self.expected_weights().values() if dtype_of(m.dtype).is_floating_point), "")

    def begin_weight_update(self, version: int, metas: Sequence[TensorMeta]) -> None:
        """Open the update to ``version``, whose tensors are ``metas`` (the whole model).

        Raises :class:`~megatron_rl.weight_sync.WeightUpdateError` (names the engine,
        the tensor and the version) when they do not fit the model; nothing changes then.
        """
        if self._update_version is not None:
            raise RuntimeError(f"{self.name}: an update to version {self._update_version} is still open")
        check_update(self.wire_weights(), metas, engine=self.name, version=int(version), require_all=True)
        self._start_update()
        self._update_version, self._update_touched = int(version), False
        if self.weight_format == "fp8":
            from megatron_rl.weight_sync.fp8 import Dequantizer

            self._dequantizer = Dequantizer(dtype_of(self.weight_dtype))

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, int]:
        """Load host tensors of the open update (any number of calls, e.g. one per bucket).

        Returns ``{"num_tensors": ..., "num_bytes": ...}`` loaded by this call.
        """
        self._require_update("load_weights")
        named = list(named_tensors)
        check_update(self.wire_weights(), [TensorMeta.of(n, t) for n, t in named], engine=self.name,
                     version=self._update_version, require_all=False)  # fmt: skip
        self._touch()
        self._load_wire(named)
        return {"num_tensors": len(named), "num_bytes": sum(t.numel() * t.element_size() for _, t in named)}

    def load_bucket(self, bucket: WeightBucket) -> dict[str, int]:
        """:meth:`load_weights` of one :class:`~megatron_rl.weight_sync.buckets.WeightBucket`
        (zero-copy views of its arrays)."""
        return self.load_weights(unpack_bucket(bucket))

    def init_weight_transfer(self, init_info: dict[str, Any]) -> None:
        """Join a sender's transfer group (once per group; see ``weight_sync``)."""
        self._join_transfer(init_info)

    def receive_weights(self, update_info: dict[str, Any]) -> None:
        """Receive the open update's tensors from the transfer group (blocks until done)."""
        self._require_update("receive_weights")
        self._touch()
        self._receive(update_info)

    def commit_weight_update(self) -> int:
        """Close the open update: its version becomes current; returns it."""
        version = self._require_update("commit_weight_update")
        if self._dequantizer is not None:
            self._dequantizer, dequantizer = None, self._dequantizer
            dequantizer.finish()  # raises if a weight lacks its scales: the caller aborts
        self._finish_update(version)
        self._version, self._update_version, self._weights_ok = version, None, True
        return version

    def abort_weight_update(self) -> None:
        """Close a failed update. If tensors had started to arrive the engine keeps a mix of
        versions and reports ``ok: False`` until a later update commits; otherwise it
        keeps its weights, as they were."""
        if self._update_version is None:
            return
        self._update_version, self._dequantizer = None, None
        try:
            self._finish_update(None)
        except Exception:
            self._weights_ok = False  # the model may be half torn down

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> dict[str, int]:
        """A whole update in one call: ``named_tensors`` (the whole model, any float dtype:
        converted to the engine's) become ``version``.

        Returns ``{"num_tensors": ..., "num_bytes": ...}`` as loaded.
        """
        expected = self.expected_weights()
        named = []
        for name, tensor in named_tensors:
            want = expected.get(name)
            if want is not None and tensor.dtype != dtype_of(want.dtype) and tensor.is_floating_point():
                tensor = tensor.to(dtype_of(want.dtype))
            named.append((name, tensor))
        if self.weight_format == "fp8":
            from megatron_rl.weight_sync.fp8 import Fp8Source

            named = list(Fp8Source(_ListSource(named)))
        self.begin_weight_update(version, [TensorMeta.of(n, t) for n, t in named])
        try:
            stats = self.load_weights(named)
        except BaseException:
            self.abort_weight_update()
            raise
        self.commit_weight_update()
        return stats

    def _await_weights(self) -> None:
        """Started without weights: version ``-1`` and no generation until an update commits."""
        self._version, self._weights_ok = -1, False

    def _touch(self) -> None:
        """Data is about to move: until the commit, a failure leaves mixed weights."""
        self._update_touched, self._weights_ok = True, False

    def _require_update(self, method: str) -> int:
        if self._update_version is None:
            raise RuntimeError(f"{self.name}: {method}() outside a weight update (call begin_weight_update first)")
        return self._update_version


class _ListSource(list):
    """``(name, tensor)`` pairs as a weight source (``metadata()`` + iteration)."""

    def metadata(self) -> list[TensorMeta]:
        return [TensorMeta.of(n, t) for n, t in self]
