"""Stopping a run on a signal without losing a step: preemption, time limits, Ctrl-C.

:class:`StopSignals` turns the first SIGTERM, SIGINT or SIGUSR1 into a request the loop
reads between steps: the step in progress finishes (an update cannot be half-applied),
a checkpoint of it is written, every process is stopped, and the run raises
:class:`RunStopped` (``megatron-rl train`` exits with code 3; rerunning the command, or
Slurm's requeue, continues at the next step). Slurm sends SIGTERM to every process of the
job at its time limit and kills them ``KillWait`` seconds later, so ``slurm/train.sbatch``
asks for USR1 some minutes before the limit instead (``--signal``), which only the
driver gets. A second signal aborts at once: one line on stderr and exit code 128 + the
signal's number, straight from the handler (an exception raised there would surface
from inside whatever Ray call the main thread waits in, mangled). The driver's reaper
(``cli/reaper.py``) then ends every process of the run, as after ``kill -9``; a
checkpoint being written never becomes ``latest`` (it is written under a temporary name
and renamed), so the rerun resumes from the last complete one.

Handlers are installed in the main thread by the CLI, before the run is built and again
after ``ray.init``, which installs its own SIGTERM handler (``sys.exit``) in the driver.
"""

from __future__ import annotations

import os
import signal
import threading

__all__ = ["STOP_SIGNALS", "RunStopped", "StopSignals"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
"""The signals that stop a run after its current step."""


class RunStopped(Exception):
    """The run stopped on a signal after ``step``; ``saved``: a checkpoint of that step was written
    (not when no step ran since the resume, or the step was skipped as non-finite)."""

    def __init__(self, signal_name: str, step: int, saved: bool):
        self.signal_name, self.step, self.saved = signal_name, step, saved
        super().__init__(f"stopped by {signal_name} after step {step}")


class StopSignals:
    """The stop request of one run; :meth:`install` puts the handlers in place."""

    def __init__(self) -> None:
        self.requested: str | None = None
        """The name of the first stop signal received, if any."""
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        """Handle :data:`STOP_SIGNALS` from now on (main thread only; again after a library
        replaced a handler). The handlers the first call found come back with :meth:`restore`."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("signal handlers can only be installed from the main thread")
        for signum in STOP_SIGNALS:
            previous = signal.signal(signum, self._handle)
            self._previous.setdefault(signum, previous)

    def restore(self) -> None:
        """Put back the handlers found by the first :meth:`install`."""
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    def request(self, signal_name: str) -> None:
        """Ask for a stop after the current step (what the first signal does)."""
        self.requested = self.requested or signal_name

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested is not None:
            os.write(2, f"error: aborted by a second stop signal ({name}); the latest checkpoint stays the latest: "
                        "rerun the same command to resume from it\n".encode())  # fmt: skip
            os._exit(128 + signum)
        self.request(name)
