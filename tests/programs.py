"""The programs a test starts as a user starts them in terminals (`rl inference`, `rl trainer`,
`rl orchestrator`, each its own process group and log), and the server launch every real-engine
test shares: a free port, float32, healthy before the test goes on."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import httpx

from conftest import free_port, rl_command


class Program:
    def __init__(self, name: str, cfg, log_dir, extra=(), log_name: str | None = None, env: dict | None = None):
        self.log = log_dir / f"{log_name or name}.log"
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(rl_command(name, "@", str(cfg), *extra), stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         env=None if env is None else {**os.environ, **env})

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


def start_server(tmp, name: str, model, output_dir, extra: str = "", env: dict | None = None) -> tuple[Program, str]:
    server, url = launch_server(tmp, name, model, output_dir, extra, env=env)
    wait_healthy(server, url)
    return server, url


def launch_server(tmp, name: str, model, output_dir, extra: str = "",
                  seq_len: int = 64, env: dict | None = None) -> tuple[Program, str]:
    port = free_port()
    cfg = tmp / f"{name}.toml"
    cfg.write_text(f'model = "{model}"\noutput_dir = "{output_dir}"\nseq_len = {seq_len}\n'
                   f'[inference]\nport = {port}\ndtype = "float32"\n' + extra)
    return Program("inference", cfg, tmp, env=env), f"http://127.0.0.1:{port}"


def wait_healthy(server: Program, url: str) -> None:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        assert server.proc.poll() is None, server.tail()
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    server.stop()
    raise AssertionError(f"server did not come up:\n{server.tail()}")


def train(cfg, tmp) -> Program:
    """Trainer and orchestrator until both exit 0 (the server runs already); the trainer."""
    trainer, orchestrator = Program("trainer", cfg, tmp), Program("orchestrator", cfg, tmp)
    try:
        assert trainer.wait(300) == 0, trainer.tail()
        assert orchestrator.wait(120) == 0, orchestrator.tail()
    finally:
        trainer.stop()
        orchestrator.stop()
    return trainer
