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


def test_rl_run_stops_everything_naming_a_frozen_trainer_dies_with_its_programs_and_resume_finishes(tmp_path):
    """A frozen trainer (SIGSTOP: alive, silent) makes `rl run` stop every program within
    seconds of the heartbeat timeout, exit non-zero naming it, and leave no process behind. The
    `rl run --resume` after it is SIGKILLed itself once it trained a step more: it takes every
    program with it. A second `--resume` finishes the run with every step trained once. (One run
    for both stops: each round is a whole `rl run` start; a failing first stop hides the second.)"""
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

    stopped_at = r.trained()
    assert stopped_at < r.max_steps - 1, f"the frozen run trained {stopped_at} steps: none left to kill the launcher in"
    with rl_run(r, out, "--resume") as launcher:
        r.wait_for(f"step {stopped_at + 1}", lambda: r.trained() > stopped_at or launcher.poll() is not None)
        children = r.pids()
        assert launcher.poll() is None and set(children) == {"inference", "trainer", "orchestrator"}, children
        launcher.kill()
    for name, pid in children.items():
        assert gone(pid, timeout=30), f"{name} (pid {pid}) outlived a SIGKILLed rl run"

    with rl_run(r, out, "--resume") as resumed:
        assert resumed.wait(timeout=400) == 0, out.read_text()[-3000:]
    r.check_complete(server_running=False)
