"""Fault-injecting engines for the pool tests, named by import path in ``rollout.engine``.

They subclass the real :class:`HFEngine` (no mocking): the only difference is a process
exit at a chosen moment, which is what a crashed engine looks like to Ray.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from megatron_rl.rollout.engines.hf import HFEngine
from megatron_rl.rollout.engines.vllm import VLLMEngine  # imports vllm only when constructed


class FaultOnce:
    """Fails once, on the first call the armed ``arm_file`` names: a crash or a hang.

    The file's content picks the fault: ``exit`` ends the process (``os._exit``), ``hang``
    blocks forever (a stuck kernel, as far as the pool can tell), in the next ``generate``;
    ``sleep:exit`` and ``sleep:hang`` do the same in the next ``sleep``, ``load:exit`` and
    ``load:hang`` while loading the next weight bucket of a sync. Every engine of
    a pool shares the file, so exactly one engine fails per arming: the one that renames
    it first (``os.rename`` is atomic). Ray then restarts the actor, whose constructor
    finds no ``arm_file`` and serves normally. Mixed into a real engine class (below).
    """

    def __init__(self, model_path: str, *, name: str = "fault-once", arm_file: str, **engine_args: Any):
        super().__init__(model_path, name=name, **engine_args)
        self.arm_file = Path(arm_file)

    def _fire(self, call: str) -> None:
        try:
            fault = self.arm_file.read_text().strip()
        except FileNotFoundError:
            return
        target, _, kind = fault.rpartition(":")
        if (target or "generate") != call:
            return
        fired = Path(f"{self.arm_file}.fired-by-{self.name}")
        try:
            os.rename(self.arm_file, fired)
        except FileNotFoundError:
            return
        if kind == "hang":
            time.sleep(3600)
        os._exit(1)

    def generate(self, prompts, params, *, prompt_seeds=None):
        self._fire("generate")
        return super().generate(prompts, params, prompt_seeds=prompt_seeds)

    def sleep(self) -> None:
        self._fire("sleep")
        return super().sleep()

    def _load_host(self, named_tensors):
        self._fire("load")
        return super()._load_host(named_tensors)


class FaultOnceEngine(FaultOnce, HFEngine):
    """The built-in engine, failing once when armed (:class:`FaultOnce`)."""


class FaultOnceVLLMEngine(FaultOnce, VLLMEngine):
    """The vLLM engine, failing once when armed (:class:`FaultOnce`): ``os._exit`` leaves
    vLLM's engine-core process to notice its parent's death by itself."""


class NoRoutesEngine(HFEngine):
    """The built-in engine, declaring that it cannot return routed experts (as a user's
    engine class without them does)."""

    routed_experts = False


class SlowStartEngine(HFEngine):
    """The built-in engine, taking ``start_delay_s`` longer to load (a large model's first load)."""

    def __init__(self, model_path: str, *, name: str = "slow-start", start_delay_s: float, **engine_args: Any):
        time.sleep(start_delay_s)
        super().__init__(model_path, name=name, **engine_args)


class AlwaysCrashEngine(HFEngine):
    """Exits its process on every ``generate``: a request to it fails even after a restart."""

    def generate(self, prompts, params, *, prompt_seeds=None):
        os._exit(1)


class FaultOnSyncEngine(HFEngine):
    """Exits its process while loading a weight update, once, when ``arm_file`` exists
    (renamed away first, so exactly one engine fails): an engine dying mid-sync."""

    def __init__(self, model_path: str, *, name: str = "fault-on-sync", arm_file: str, **engine_args: Any):
        super().__init__(model_path, name=name, **engine_args)
        self.arm_file = Path(arm_file)

    def _load_host(self, named_tensors):
        try:
            os.rename(self.arm_file, f"{self.arm_file}.fired-by-{self.name}")
        except FileNotFoundError:
            return super()._load_host(named_tensors)
        os._exit(1)


class RaisesOnGenerateEngine(HFEngine):
    """Raises (the process lives on) on every ``generate`` whose prompt starts with token
    ``bad_token``: an engine bug, as opposed to a crash."""

    def __init__(self, model_path: str, *, name: str = "raises", bad_token: int = 0, **engine_args: Any):
        super().__init__(model_path, name=name, **engine_args)
        self.bad_token = bad_token

    def generate(self, prompts, params, *, prompt_seeds=None):
        if any(p and p[0] == self.bad_token for p in prompts):
            raise RuntimeError(f"refusing prompts that start with {self.bad_token}")
        return super().generate(prompts, params, prompt_seeds=prompt_seeds)
