"""Kill the inference server mid-generation: no vLLM process outlives it, the orchestrator takes
it out of rotation, and a restarted server catches the run up (the run and its checks:
real_run.py)."""

from __future__ import annotations

import os
import signal
import subprocess

import psutil
import pytest

from conftest import free_port
from real_run import MAX_STEPS, RealRun, gone, in_log

pytestmark = pytest.mark.slow


def test_inference_killed_mid_generation_leaves_no_process_and_a_restart_catches_up(tmp_path):
    """With vLLM's own worker process (inference.one_process_engine off): the most processes a
    one-worker server has, all gone with it; the run on that layout trains to the end."""
    r = RealRun(tmp_path, free_port())
    two_processes = ("--inference.one_process_engine", "false")
    try:
        server = r.start_server(*two_processes)
        trainer, orchestrator = r.start("trainer"), r.start("orchestrator")
        r.wait_for("step 2", lambda: r.trained() >= 2, watch=(trainer, orchestrator))
        layout = [p.name() for p in psutil.Process(server.proc.pid).children(recursive=True)]
        assert {"VLLM::EngineCore", "VLLM::Worker"} <= set(layout), layout
        os.kill(server.proc.pid, signal.SIGKILL)  # the main process alone, as the OOM killer would
        server.proc.wait(timeout=10)  # reaped, as its parent would: what is left of its group is vLLM's
        r.wait_for("the orchestrator to report the server", lambda: in_log(orchestrator, f"server {r.url} out of rotation"),
                   timeout=30, watch=(orchestrator,))
        # vLLM's engine process does not outlive the server it belongs to.
        assert gone(server.proc.pid), subprocess.run(["ps", "-o", "pid,pgid,cmd", "-g", str(server.proc.pid)],
                                                     capture_output=True, text=True).stdout
        stalled_at = r.trained()
        r.start_server(*two_processes)
        r.finish(trainer, orchestrator)
        assert stalled_at < MAX_STEPS, "the run did not need the restarted server"
        assert in_log(orchestrator, f"server {r.url} back in rotation")
        r.check_complete()
    finally:
        r.stop_all()
