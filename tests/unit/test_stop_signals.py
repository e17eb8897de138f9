"""Stop signals (``loop.stop``): the first one is a request the loop reads, a second one
ends the process at once with 128 + its number; checkpoint retention (``prune_checkpoints``)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

from megatron_rl.config.lib import ConfigError
from megatron_rl.config.trainer import TrainerConfig
from megatron_rl.storage.checkpoints import prune_checkpoints, read_latest, write_latest

pytestmark = pytest.mark.unit

_PROGRAM = textwrap.dedent("""
    import os, signal, time
    from megatron_rl.loop.stop import StopSignals
    stop = StopSignals()
    stop.install()
    os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(0.1)
    print("requested", stop.requested, flush=True)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)
    print("not reached", flush=True)
""")


def test_the_first_signal_is_a_request_and_the_second_aborts_with_its_code():
    proc = subprocess.run([sys.executable, "-c", _PROGRAM], capture_output=True, text=True, timeout=60)
    assert proc.stdout.splitlines() == ["requested SIGUSR1"]
    assert proc.returncode == 128 + signal.SIGINT
    assert proc.stderr.startswith("error: aborted by a second stop signal (SIGINT)")


def test_restore_puts_the_previous_handlers_back():
    from megatron_rl.loop.stop import STOP_SIGNALS, StopSignals

    before = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    stop = StopSignals()
    stop.install()
    stop.install()  # again (after a library replaced one): the first one's handlers are kept
    stop.restore()
    assert {s: signal.getsignal(s) for s in STOP_SIGNALS} == before


def _checkpoints(folder, steps):
    for step in steps:
        (folder / f"step_{step:06d}").mkdir(parents=True)
    write_latest(folder, f"step_{max(steps):06d}")


def test_prune_keeps_the_newest_the_multiples_and_latest(tmp_path):
    _checkpoints(tmp_path, [2, 4, 6, 8, 10, 12])
    deleted = prune_checkpoints(tmp_path, keep_last=2, keep_every_steps=4)
    assert sorted(p.name for p in deleted) == ["step_000002", "step_000006"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", *(f"step_{s:06d}" for s in (4, 8, 10, 12))]
    # ``latest`` naming an older checkpoint (the newest was written after a skipped step's
    # refusal?) is never deleted, whatever its age.
    write_latest(tmp_path, "step_000004")
    (tmp_path / "step_000014").mkdir()
    prune_checkpoints(tmp_path, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000004", "step_000014"]
    assert read_latest(tmp_path).name == "step_000004"
    assert prune_checkpoints(tmp_path, keep_last=0) == []  # 0 keeps all


def test_retention_settings_are_checked():
    with pytest.raises(ConfigError, match="keep_every_steps"):
        TrainerConfig(keep_every_steps=4)  # without keep_last_checkpoints: nothing to prune
    with pytest.raises(ConfigError, match="not a multiple of save_every_steps"):
        TrainerConfig(keep_last_checkpoints=2, keep_every_steps=5, save_every_steps=2)
    with pytest.raises(ConfigError, match="keep_last_checkpoints"):
        TrainerConfig(keep_last_checkpoints=-1)
    TrainerConfig(keep_last_checkpoints=2, keep_every_steps=4, save_every_steps=2)
