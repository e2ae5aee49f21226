"""The orchestrator takes only its run's servers (orchestrator/servers/identity.py): a program
answering at the URL a server of this run announces, but naming another instance, never joins
rotation; the run's own server joins once its heartbeat announces it; a listed server with no
heartbeat here joins on /health alone. Seen in CI: two `rl run`s on port 8000, the second's
server failed to bind and its orchestrator sampled from the first run's server.

The stand-in server (tests/fake_inference.py) gives control over the instance it names; the real
server's /health names its heartbeat's instance (tests/inference/test_inference_server.py)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import aiohttp
import pytest

from conftest import ROOT, TINY_MODEL, free_port, rl_command
from fake_inference import FakeServer, start
from rl.config import load_config
from rl.heartbeat import server_heartbeat_path
from rl.inference_api import connector

OURS, THEIRS = "101@here 1700000000.000", "202@here 1700000001.000"


def announce(root, url: str, instance: str) -> None:
    """What the run's server's heartbeat holds (rl/heartbeat.py): instance, beat, url."""
    path = server_heartbeat_path(root, url)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{instance}\n1 0s starting\nurl {url}\n")


def run_config(tmp_path, port: int, listed: bool = False):
    args = ["--model", str(TINY_MODEL), "--output_dir", str(tmp_path), "--inference.port", str(port)]
    if listed:
        args += ["--orchestrator.servers.urls", f'["http://127.0.0.1:{port}"]']
    return load_config(args)[0]


def with_pool(cfg, server: FakeServer, body):
    from orchestrator.servers.pool import ServerPool

    gone = []

    async def main():
        runner = await start(server, cfg.inference.port)
        try:
            async with aiohttp.ClientSession(connector=connector()) as session:
                return await body(ServerPool.for_run(cfg, session, on_fail=gone.append)), gone
        finally:
            await runner.cleanup()

    return asyncio.run(main())


def test_a_server_naming_another_instance_than_announced_never_joins(tmp_path):
    cfg = run_config(tmp_path, free_port())
    url = cfg.inference.url
    announce(tmp_path, url, OURS)
    server = FakeServer(instance=THEIRS)

    async def body(pool):
        with pytest.raises(TimeoutError, match=rf"another program holds port {cfg.inference.port}: "
                                               rf"it answers as {THEIRS}, while .* announces {OURS}"):
            await pool.connect(timeout_s=1.0)
        refused = (pool.in_rotation, server.requests)
        server.instance = OURS  # the announced one answers: it joins
        await pool.connect(timeout_s=5.0)
        return refused, [s.url for s in pool.in_rotation]

    ((in_rotation, requests), joined), _ = with_pool(cfg, server, body)
    assert in_rotation == [] and requests == {}
    assert joined == [url]


def test_the_runs_own_server_joins_once_announced_and_a_listed_one_without_a_heartbeat_at_once(tmp_path):
    cfg = run_config(tmp_path, free_port())
    server = FakeServer(instance=OURS)

    async def own(pool):
        with pytest.raises(TimeoutError, match=r"no heartbeat announces it yet"):
            await pool.connect(timeout_s=1.0)
        announce(tmp_path, cfg.inference.url, OURS)
        await pool.connect(timeout_s=5.0)
        return len(pool.in_rotation)

    assert with_pool(cfg, server, own)[0] == 1

    listed = run_config(tmp_path / "listed", free_port(), listed=True)  # started elsewhere: no heartbeat here

    async def at_once(pool):
        await pool.connect(timeout_s=5.0)
        return len(pool.in_rotation)

    assert with_pool(listed, FakeServer(instance=THEIRS), at_once)[0] == 1


def test_a_server_in_rotation_whose_port_another_program_took_leaves_it_with_its_groups(tmp_path):
    """Ours died and another program took its port between two health checks (its heartbeat not
    yet silent): out of rotation at the next check, its groups requeued (on_fail), named."""
    cfg = run_config(tmp_path, free_port())
    announce(tmp_path, cfg.inference.url, OURS)
    server = FakeServer(instance=OURS)

    async def body(pool):
        await pool.connect(timeout_s=5.0)
        joined = len(pool.in_rotation)
        server.instance = THEIRS
        await pool.check()
        return joined, pool.in_rotation, pool.servers[0].last_error

    (joined, after, why), gone = with_pool(cfg, server, body)
    assert joined == 1 and after == [] and len(gone) == 1
    assert why.startswith(f"another program holds port {cfg.inference.port}")


def test_rl_orchestrator_whose_server_port_another_program_holds_names_it_and_stops(tmp_path):
    """The real program: its run announces a server on a port that a stand-in (another program,
    naming no instance) holds; the orchestrator says so and gives up at its wait."""
    port = free_port()
    cfg = tmp_path / "run.toml"
    cfg.write_text(f'model = "{TINY_MODEL}"\noutput_dir = "{tmp_path / "run"}"\nmax_steps = 2\nseq_len = 64\n'
                   f"[inference]\nport = {port}\n[orchestrator.timeouts]\nserver_wait_s = 8\n")
    announce(tmp_path / "run", f"http://127.0.0.1:{port}", OURS)
    other = subprocess.Popen([sys.executable, str(ROOT / "tests" / "fake_inference.py"), str(port)])
    try:
        result = subprocess.run(rl_command("orchestrator", "@", str(cfg)), capture_output=True, text=True,
                                timeout=180)
    finally:
        other.kill()
        other.wait()
    assert result.returncode != 0
    said = result.stderr
    assert f"not joining: another program holds port {port}: it answers as a server naming no instance" in said, said[-3000:]
    assert "not healthy after 8 s" in said
    assert "batch 1" not in said  # nothing was sampled from it
