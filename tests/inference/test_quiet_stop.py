"""`rl inference` stopped by Ctrl-C says what a user needs and nothing alarming: on a real vLLM
server with a tied model (the tiny one), after a reload, SIGINT to its process group (what a
terminal's Ctrl-C sends: the server, vLLM's engine core and worker, multiprocessing's resource
tracker) ends it within its own shutdown bounds, exit code 0, and its output holds the readiness
line but neither multiprocessing's resource tracker warnings, "leaked shared_memory" and "leaked
semaphore" (vLLM SIGKILLed its engine core right after asking it to stop:
inference/server.py --shutdown-timeout), nor the "Failed to load
weights" vLLM said of the tied lm_head and the rotary embedding at every reload (neither has
weights in a checkpoint: inference/worker_extension.py NothingToLoad)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess

import httpx
import pytest

from conftest import TINY_MODEL
from inference.server import SHUTDOWN_GRACE_S
from rl.rundir import RunDir, mark_stable
from programs import launch_server, wait_healthy

pytestmark = pytest.mark.slow

# What the stop may take by the server's own bounds: vLLM drains requests, then waits for its
# engine core, SHUTDOWN_GRACE_S each; the HTTP server's shutdown is cut at 4 x SHUTDOWN_GRACE_S;
# then the interpreter exits (a loaded machine: 30 s for that).
STOP_BOUND_S = 6 * SHUTDOWN_GRACE_S + 30


def test_ctrl_c_after_a_reload_stops_quietly(tmp_path):
    assert "tie_word_embeddings" in (TINY_MODEL / "config.json").read_text()
    run = RunDir(tmp_path / "run")
    version_1 = run.weights_dir(1)
    shutil.copytree(TINY_MODEL, version_1)
    mark_stable(version_1)
    proc, url = launch_server(tmp_path, "server", TINY_MODEL, run.root)
    try:
        wait_healthy(proc, url)
        r = httpx.post(f"{url}/update_weights", timeout=120, json={"path": str(version_1), "version": 1})
        assert r.status_code == 200, r.text
        r = httpx.post(f"{url}/generate", timeout=60, json={"request_id": "a", "prompt_token_ids": [3, 4],
                                                            "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and set(r.json()["samples"][0]["versions"]) == {1}, r.text
        os.killpg(proc.proc.pid, signal.SIGINT)
        try:
            code = proc.wait(STOP_BOUND_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running {STOP_BOUND_S} s after Ctrl-C:\n{proc.tail()}") from None
    finally:
        proc.stop()
    out = proc.log.read_text(errors="replace")
    assert code == 0, proc.tail()
    assert "inference INFO ready: serving" in out
    assert "now serving version 1" in out
    # multiprocessing's resource tracker warns of each shared memory segment and semaphore left
    # behind ("resource_tracker: There appear to be N leaked shared_memory / semaphore objects");
    # triton's bindings, if installed, printed ~70 "nanobind: leaked ..." lines at exit (make
    # install removes triton: vLLM does not use it on CPU).
    leaks = [line for line in out.splitlines() if "resource_tracker" in line or "leaked shared_memory" in line
             or "leaked semaphore" in line or "nanobind: leaked" in line]
    assert not leaks, leaks
    assert "Failed to load weights" not in out, [line for line in out.splitlines() if "Failed to load" in line]
