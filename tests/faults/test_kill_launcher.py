"""`rl run` and its three programs: a frozen child stops them all, naming it, and `--resume`
finishes the run; a killed launcher takes every program with it (the run and its checks:
real_run.py)."""

from __future__ import annotations

import os
import signal

import pytest

from conftest import free_port
from real_run import RealRun, gone, rl_run

pytestmark = pytest.mark.slow


def test_rl_run_stops_everything_naming_a_frozen_trainer_and_resume_finishes(tmp_path):
    """A frozen trainer (SIGSTOP: alive, silent) makes `rl run` stop every program within
    seconds of the heartbeat timeout, exit non-zero naming it, and leave no process behind;
    `rl run --resume` then finishes the run with every step trained once."""
    r = RealRun(tmp_path, free_port())
    out = tmp_path / "rl_run.log"
    with rl_run(r, out) as launcher:
        r.wait_for("step 2", lambda: r.trained() >= 2)
        children = r.pids()
        assert set(children) == {"inference", "trainer", "orchestrator"}, children
        os.kill(children["trainer"], signal.SIGSTOP)
        assert launcher.wait(timeout=75) == 1, out.read_text()
    assert "rl run: trainer silent for" in out.read_text(), out.read_text()
    for name, pid in children.items():
        assert gone(pid, timeout=5), f"{name} (pid {pid}) outlived rl run"
    with rl_run(r, out, "--resume") as resumed:
        assert resumed.wait(timeout=400) == 0, out.read_text()[-3000:]
    r.check_complete(server_running=False)


def test_a_killed_launcher_takes_every_program_with_it(tmp_path):
    r = RealRun(tmp_path, free_port())
    with rl_run(r, tmp_path / "rl_run.log") as launcher:
        r.wait_for("step 1", lambda: r.trained() >= 1)
        children = r.pids()
        assert set(children) == {"inference", "trainer", "orchestrator"}, children
        launcher.kill()
    for name, pid in children.items():
        assert gone(pid, timeout=30), f"{name} (pid {pid}) outlived a SIGKILLed rl run"
