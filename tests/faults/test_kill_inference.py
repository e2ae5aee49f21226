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


def listeners(server, port: int) -> set[int]:
    """The pids of the server and its descendants with a socket listening on `port`. Per process:
    psutil's system-wide list names one process per socket, however many hold it."""
    root = psutil.Process(server.proc.pid)
    found = set()
    for p in [root, *root.children(recursive=True)]:
        try:
            sockets = p.net_connections(kind="tcp")
        except psutil.NoSuchProcess:  # a short-lived helper that ended since children() listed it
            continue
        found |= {p.pid for c in sockets if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
    return found


def listening(port: int) -> bool:
    """Whether any process listens on `port`."""
    return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
               for c in psutil.net_connections(kind="tcp"))


def layout(server) -> list[str]:
    return [p.name() for p in psutil.Process(server.proc.pid).children(recursive=True)]


def test_inference_killed_mid_generation_leaves_no_process_and_a_restart_catches_up(tmp_path):
    """Both engine layouts in one run: killed mid-generation, the server with vLLM's own worker
    process (inference.one_process_engine off: the most processes a one-worker server has); the
    restart, on the default layout (the engine core forked from the server, computing itself),
    killed once the run trained to the end. Each time only the server's own process listens on
    the port, and nothing of it outlives the kill: a restart on the same port gets the port."""
    r = RealRun(tmp_path, free_port())
    two_processes = ("--inference.one_process_engine", "false")
    try:
        server = r.start_server(*two_processes)
        trainer, orchestrator = r.start("trainer"), r.start("orchestrator")
        r.wait_for("step 2", lambda: r.trained() >= 2, watch=(trainer, orchestrator))
        assert {"VLLM::EngineCore", "VLLM::Worker"} <= set(layout(server)), layout(server)
        assert listeners(server, r.port) == {server.proc.pid}
        os.kill(server.proc.pid, signal.SIGKILL)  # the main process alone, as the OOM killer would
        server.proc.wait(timeout=10)  # reaped, as its parent would: what is left of its group is vLLM's
        r.wait_for("the orchestrator to report the server", lambda: in_log(orchestrator, f"server {r.url} out of rotation"),
                   timeout=30, watch=(orchestrator,))
        # vLLM's engine process does not outlive the server it belongs to.
        assert gone(server.proc.pid), subprocess.run(["ps", "-o", "pid,pgid,cmd", "-g", str(server.proc.pid)],
                                                     capture_output=True, text=True).stdout
        stalled_at = r.trained()
        server = r.start_server()  # the same port: start_server fails if anything still held it
        names = layout(server)
        assert names.count("VLLM::EngineCore") == 1 and not [n for n in names if "Worker" in n], names
        # The forked engine core closed its copy of the listening socket (inference/server.py).
        assert listeners(server, r.port) == {server.proc.pid}
        r.finish(trainer, orchestrator)
        assert stalled_at < MAX_STEPS, "the run did not need the restarted server"
        assert in_log(orchestrator, f"server {r.url} back in rotation")
        r.check_complete()
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait(timeout=10)
        assert gone(server.proc.pid), subprocess.run(["ps", "-o", "pid,pgid,cmd", "-g", str(server.proc.pid)],
                                                     capture_output=True, text=True).stdout
        assert not listening(r.port)
    finally:
        r.stop_all()
