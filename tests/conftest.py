from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY_MODEL = ROOT / "models" / "tiny-reverse"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rl_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "rl", *args]


@pytest.fixture
def write_toml(tmp_path):
    def write(text: str, name: str = "cfg.toml") -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path

    return write


# --- running the suite on several workers (pytest-xdist, `make test`) -------------------------


def pytest_configure(config):
    """Worker n's vLLM engines compute on core n (modulo the cores there are): vLLM's CPU
    engine binds its OpenMP threads to fixed cores (core 0 unless told), so engines started by
    different workers would otherwise all share one core and leave the others idle. (With
    three workers on two cores, `make test`'s default, gw0 and gw2 share core 0.)"""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw"):
        cores = sorted(os.sched_getaffinity(0))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(cores[int(worker[2:]) % len(cores)]))


def pytest_collection_modifyitems(config, items):
    """Slow tests (real engines, trainers, hosts) go first: `make test` hands whole files to the
    workers (`--dist loadfile`: a module-scoped server starts once), and a long file picked up
    last would leave the other worker idle at the end."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: order kept within


def pytest_terminal_summary(terminalreporter):
    """Which kind of hosts each multi-host test ran on (`hosts_mode`, recorded by
    test_multi_host.py: network namespaces, or the loopback fallback and why), one line each,
    so a run shows what it proved. Reads the reports' user_properties: works under xdist and -q."""
    modes, outcomes = {}, {}
    for reports in terminalreporter.stats.values():
        for rep in reports:
            props = dict(getattr(rep, "user_properties", None) or ())
            if "hosts_mode" not in props:
                continue
            modes[rep.nodeid] = props["hosts_mode"]
            if rep.failed:
                outcomes[rep.nodeid] = "failed"
            elif rep.when == "call" or rep.skipped:
                outcomes.setdefault(rep.nodeid, rep.outcome)
    if modes:
        terminalreporter.write_sep("-", "multi-host: hosts mode")
        for nodeid, mode in sorted(modes.items()):
            terminalreporter.write_line(f"hosts_mode={mode}: {nodeid} {outcomes.get(nodeid, '?')}")
