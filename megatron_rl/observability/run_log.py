"""Where a run's log records go: everything to files in ``RUN_DIR/logs``, only the
project's own warnings and errors to the screen, and the libraries' errors in the driver.

A normal run's screen holds the progress line and what needs the user's attention. The
notices of the libraries underneath (megatron-core's "Apex is not installed", deprecation
warnings, Ray's token-authentication notice, transformers' loading bars) go to
``RUN_DIR/logs/driver.log`` and to one file per Ray worker process
(``RUN_DIR/logs/worker-<pid>.log``; each actor rank and engine names itself in its file),
where they can still be read. A library's error in a worker (megatron-core's checkpoint
writer on a full disk, say) stays in the worker's file: the failure reaches the driver as
the exception of the call, which the driver reports as one ``error:`` line.

The driver calls :func:`setup_process_logging`; the builder starts Ray with
:func:`setup_worker_logging` as the job's ``worker_process_setup_hook`` and the log
directory in :data:`LOG_DIR_ENV`.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from pathlib import Path

__all__ = ["FILE_ONLY", "LOG_DIR_ENV", "setup_process_logging", "setup_worker_logging"]

LOG_DIR_ENV = "MEGATRON_RL_LOG_DIR"
"""Environment variable naming the run's log directory in its Ray workers."""

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

FILE_ONLY = {"file_only": True}
"""``extra=`` of a record for the log file alone: a traceback behind an ``error:`` line the
screen shows already."""


class _ScreenFilter(logging.Filter):
    """The project's records at the console level, and (``library_errors``) anyone's errors;
    never :data:`FILE_ONLY` ones."""

    def __init__(self, *, library_errors: bool):
        super().__init__()
        self.library_errors = library_errors

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "file_only", False):
            return False
        ours = record.name.split(".")[0] == "megatron_rl"
        return ours or (self.library_errors and record.levelno >= logging.ERROR)


class _QuietFileHandler(logging.FileHandler):
    """A log file whose write failures (a full disk) drop the record instead of printing
    logging's own traceback on the screen, where the run's ``error:`` line already is."""

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802  (logging's name)
        pass


_PACKAGE_DIR = str(Path(__file__).resolve().parents[1]) + os.sep  # .../megatron_rl/


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """``warnings.showwarning`` of a run's processes: a warning raised in this package (or
    of one of its warning classes) is a ``megatron_rl.warnings`` record, shown on screen
    and written to the file; any other (and a deprecation notice of a library's class) is a
    ``py.warnings`` record, written to the file only."""
    # A library's deprecation notice can point into this package (the frame that called the
    # library, e.g. the CPU shim's pass-through of every torch call): not ours to show.
    ours = category.__module__.split(".")[0] == "megatron_rl" or (
        str(filename).startswith(_PACKAGE_DIR) and not issubclass(category, (DeprecationWarning, FutureWarning)))
    # Ours without the source line (``warnings.warn(``), which says nothing on a screen.
    text = warnings.formatwarning(message, category, filename, lineno, "" if ours else line).rstrip()
    logging.getLogger("megatron_rl.warnings" if ours else "py.warnings").warning("%s", text)


def setup_process_logging(
    log_file: Path, *, console_level: int = logging.WARNING, library_errors_on_screen: bool = True
) -> None:
    """Send this process's log records (INFO and up, Python warnings included) to
    ``log_file`` and only the project's (``console_level`` and up, its own Python
    warnings included) and, with ``library_errors_on_screen``, other libraries' errors to
    stderr. Idempotent: the handlers it added before are replaced."""
    log_file = Path(log_file)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    for handler in [h for h in root.handlers if getattr(h, "_megatron_rl", False)]:
        root.removeHandler(handler)
        handler.close()
    file_handler = _QuietFileHandler(log_file, encoding="utf-8")
    file_handler.setLevel(logging.INFO)
    file_handler.setFormatter(logging.Formatter(_FORMAT))
    screen = logging.StreamHandler(sys.stderr)
    screen.setLevel(console_level)
    screen.addFilter(_ScreenFilter(library_errors=library_errors_on_screen))
    screen.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    for handler in (file_handler, screen):
        handler._megatron_rl = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    root.setLevel(min(root.level or logging.WARNING, logging.INFO))
    warnings.showwarning = _show_warning
    # Ray's logger prints through a stderr handler of its own (not the root's): route it
    # through the handlers above, so its notices reach the file and its errors the screen.
    import ray  # noqa: F401  (installs that handler; imported here so it is there to replace)

    ray_logger = logging.getLogger("ray")
    for handler in list(ray_logger.handlers):
        ray_logger.removeHandler(handler)
    ray_logger.propagate = True


def setup_worker_logging() -> None:
    """Ray's ``worker_process_setup_hook`` for a run's workers (actor ranks, engines, reward
    and helper tasks): runs when the worker process starts, before it imports the classes
    it will host (whose imports warn), and logs to ``<log dir>/worker-<pid>.log`` as
    :func:`setup_process_logging` does; also turns off transformers' progress bars. Does
    nothing without :data:`LOG_DIR_ENV` (a bare ``ray.init``, as in tests)."""
    directory = os.environ.get(LOG_DIR_ENV)
    if not directory:
        return
    setup_process_logging(Path(directory) / f"worker-{os.getpid()}.log", library_errors_on_screen=False)
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_progress_bar()
