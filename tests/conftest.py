from __future__ import annotations

import itertools
import os
import socket
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# tests/ mirrors src/ by program (rl, asyncrl, orchestrator, trainer, inference, tasks), with
# integration/ (several programs together), faults/ and docs/ apart; the helpers every folder
# uses (samples, fake_inference, hosts, float32_rounding, ...) stay here beside conftest. Test
# modules also import helpers from one another by module name (test_end_to_end's server
# launch, test_scheduling's stand-ins): every folder on the path, whichever file runs alone.
sys.path[1:1] = [str(p) for p in sorted(ROOT.joinpath("tests").iterdir()) if p.is_dir() and p.name[0] not in "._"]
TINY_MODEL = ROOT / "models" / "tiny-reverse"


# Ports for the tests' servers come from below the kernel's ephemeral range, where bind(port 0)
# and the local end of every outgoing connection get theirs: a port found free there can be
# taken by some connection before the server binds it, seconds later (seen in a three-worker
# run: vLLM's "Address already in use"). Each xdist worker hands out its own slice, in turn, so
# neither another worker nor a recent test of the same worker gets the same port.
PORTS_FROM = 20000


def _port_slice() -> range:
    try:
        ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768  # Linux's default
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index, count = int(worker[2:] or 0), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    width = (ephemeral - PORTS_FROM) // max(count, 1)
    return range(PORTS_FROM + index * width, PORTS_FROM + (index + 1) * width)


# Each process starts at its own place in its slice: two pytest runs side by side without xdist
# (or two `make test`s) share a slice, and both starting at its first port took the same ones
# ("Address already in use", seen with two single-file runs on one machine).
_ports = itertools.count(os.getpid() * 613)


def free_port() -> int:
    ports = _port_slice()
    for _ in range(len(ports)):
        port = ports[next(_ports) % len(ports)]
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use (or in TIME_WAIT): the next one
            return port
    with socket.socket() as s:  # no slice to take from (an unusual ephemeral range): any free port
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rl_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "asyncrl", *args]


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
    # xdist hands out files in the order collected here only without its own reordering, which is
    # on by default (--loadscope-reorder: files with the most tests first), and which put
    # test_multi_host.py, test_random_kills.py and test_kill_inference.py, one test each and among
    # the longest files, at the very end of the queue (pytest-xdist 3.8, xdist/scheduler/loadscope.py).
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


# The files (by name) that hold a worker longest, longest first: handed out first, so that none of them
# starts while the other workers are finishing (docs/performance.md, "The suite's order": each
# file alone, `pytest -p no:xdist FILE`, and the files' totals of a `make test --junitxml` on 2 cores).
LONGEST = ["test_gpu_check.py", "test_context_parallel.py", "test_kill_restart.py", "test_trainer.py",
           "test_expert_parallel.py", "test_sft_generation_eval.py", "test_slurm_cluster.py",
           "test_prometheus_scrape.py",
           "test_lora_trainer.py", "test_broadcast.py", "test_end_to_end.py", "test_random_kills.py",
           "test_multi_host.py", "test_agent_environment.py", "test_kill_inference.py",
           "test_sampling_mask.py", "test_kill_launcher.py", "test_engine_stalls_vllm.py",
           "test_inference_server.py"]


def pytest_collection_modifyitems(config, items):
    """The longest files first (LONGEST), then the other slow tests (real engines, trainers,
    hosts), then the rest: `make test` hands whole files to the workers (`--dist loadfile`: a
    module-scoped server starts once), and a long file picked up last would leave the other
    workers idle at the end."""
    def rank(item) -> tuple[int, int]:
        name = item.path.name  # test file names are unique across tests/'s folders
        if name in LONGEST:
            return 0, LONGEST.index(name)
        return (1 if item.get_closest_marker("slow") else 2), 0

    items.sort(key=rank)  # stable: the order within a file is kept


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
