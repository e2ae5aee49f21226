"""A sandboxed run's total (issue 60, item 9): all its processes together, with the kernel memory
they cause, stay within Limits.total_mb where the host gives cgroups (orchestrator/rollout/
sandbox_cgroup.py), and the runs at once within orchestrator.sandbox.memory_mb (sandbox_budget.py).

The figures are taken from outside, independently of the bound: the proportional set size of
every process carrying the run's mark (children forked without exec carry their parent's
command line), and the growth of the kernel's TCP memory (/proc/net/sockstat; the run's loopback
is its own, its buffers are not) while it runs. The kernel's own peak for the run's cgroup is
checked beside them."""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
from pathlib import Path

import pytest

from orchestrator.sandbox import sandbox, sandbox_budget
from orchestrator.sandbox.sandbox import Limits, Sandbox
from orchestrator.sandbox.sandbox_cgroup import Bound

cgroup = pytest.mark.skipif(not isinstance(Bound.detect(), Bound) or Sandbox.isolation() is not None,
                            reason=f"no cgroup bound here: {Sandbox.total()}")
MB = 2**20
# Each child forked to the process limit fills most of its address space and holds it.
FORK_FILL = """
import os, time
r, w = os.pipe()
forked = 0
while True:
    try:
        pid = os.fork()
    except BlockingIOError:
        break
    if pid == 0:
        os.close(r)
        held = b"x" * (FILL_MB << 20)
        os.write(w, b"1")
        time.sleep(HOLD_S)
        os._exit(0)
    forked += 1
os.close(w)
held = b""
while chunk := os.read(r, 64):
    held += chunk
print(forked, len(held))
"""
# Each child fills loopback TCP buffers: connections to its own listener, written to until the
# kernel refuses, never read.
SOCKET_FILL = """
import os, socket, time
r, w = os.pipe()
forked = 0
while True:
    try:
        pid = os.fork()
    except BlockingIOError:
        break
    if pid == 0:
        os.close(r)
        server, kept, sent = socket.create_server(("127.0.0.1", 0)), [], 0
        try:
            while True:
                client = socket.create_connection(server.getsockname())
                kept += [client, server.accept()[0]]
                client.setblocking(False)
                try:
                    while True:
                        sent += client.send(b"x" * 65536)
                except OSError:
                    pass
        except OSError:  # out of descriptors
            pass
        os.write(w, b"%d\\n" % sent)
        time.sleep(HOLD_S)
        os._exit(0)
    forked += 1
os.close(w)
out = b""
while chunk := os.read(r, 4096):
    out += chunk
print(forked, sum(map(int, out.split())))
"""


def _pss_mb(mark: str) -> float:
    total = 0
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and mark in (proc / "cmdline").read_text(errors="replace"):
                rollup = (proc / "smaps_rollup").read_text()
                total += int(rollup.split("\nPss:")[1].split()[0])
        except (OSError, IndexError):
            pass
    return total / 1024


def _tcp_mb() -> float:
    for line in Path("/proc/net/sockstat").read_text().splitlines():
        if line.startswith("TCP:"):
            fields = line.split()
            return int(fields[fields.index("mem") + 1]) * os.sysconf("SC_PAGE_SIZE") / MB
    return 0.0


def _measured(code: str, limits: Limits) -> tuple[object, float, float]:
    """(the run's result, the most its processes held at once, the most TCP memory grew): sampled
    from outside while it runs."""
    mark = f"sandbox-total-{uuid.uuid4().hex}"
    peaks, done, base = [0.0, 0.0], threading.Event(), _tcp_mb()

    def sample():
        while not done.is_set():
            peaks[0] = max(peaks[0], _pss_mb(mark))
            peaks[1] = max(peaks[1], _tcp_mb() - base)
            time.sleep(0.02)

    watcher = threading.Thread(target=sample)
    watcher.start()
    try:
        result = asyncio.run(Sandbox(limits).run(f"{code}\n# {mark}\n"))
    finally:
        done.set()
        watcher.join()
    return result, peaks[0], peaks[1]


LIMITS = Limits(wall_s=30, cpu_s=20, memory_mb=200, processes=6, total_mb=256)


@cgroup
def test_a_run_forking_to_its_process_limit_each_child_filling_memory_stays_within_its_total():
    code = FORK_FILL.replace("FILL_MB", "150").replace("HOLD_S", "3")
    result, pss, _ = _measured(code, LIMITS)
    assert result.outcome == "ok", result
    forked, filled = map(int, result.stdout.split())
    # The canary: it forked to the process limit (bwrap's init and the program count there too),
    # and one child alone fills 150 MB, so together they would hold 4 x 150 MB. Either a child
    # finished its fill, or the kernel's OOM killer took each mid-fill after the run had held at
    # least one child's 150 MB (seen once: all four killed, none reported).
    assert forked == LIMITS.processes - 2, result.stdout
    assert filled >= 1 or (result.peak_mb or 0) >= 150, (result.stdout, result.peak_mb)
    assert pss <= LIMITS.total_mb, f"the run's processes held {pss:.0f} MB at once, over its {LIMITS.total_mb} MB"
    assert result.peak_mb is not None and result.peak_mb <= LIMITS.total_mb


@cgroup
def test_a_run_filling_loopback_socket_buffers_stays_within_its_total():
    code = SOCKET_FILL.replace("HOLD_S", "3")
    result, pss, tcp = _measured(code, LIMITS)
    assert result.outcome == "ok", result
    forked, sent = map(int, result.stdout.split())
    assert forked == LIMITS.processes - 2 and sent > 0, result.stdout  # the canary: they wrote and held
    assert pss + tcp <= LIMITS.total_mb, f"processes {pss:.0f} MB + TCP buffers {tcp:.0f} MB at once"
    assert tcp <= LIMITS.total_mb / 4 + 16, f"TCP buffers grew by {tcp:.0f} MB"  # its share; others' traffic
    assert result.peak_mb is not None and result.peak_mb <= LIMITS.total_mb


def test_the_start_up_line_says_which_bound_holds(monkeypatch):
    line = Sandbox.describe()
    bound = Bound.detect()
    assert ("cgroup v" in line) == isinstance(bound, Bound), line
    monkeypatch.setattr(sandbox, "_bound", lambda: "no cgroup v2 mount; no cgroup v1 memory and pids controllers")
    assert "run total: rlimits only (512 MB a process x 16 processes, kernel memory unbounded): no cgroup v2" \
        in Sandbox.describe()


def test_a_delegated_cgroup_v2_is_chosen_over_v1(tmp_path):
    """The choice, on a cgroup tree laid out as a systemd scope with Delegate=yes shows it (no
    such host here: this machine's v2 has no controllers)."""
    scope = tmp_path / "v2" / "user.slice" / "run.scope"
    scope.mkdir(parents=True)
    (scope / "cgroup.controllers").write_text("cpu memory pids\n")
    (scope / "cgroup.subtree_control").write_text("memory pids\n")
    (tmp_path / "mounts").write_text(f"cgroup2 {tmp_path / 'v2'} cgroup2 rw 0 0\n"
                                     f"cgroup {tmp_path / 'mem'} cgroup rw,memory 0 0\n")
    (tmp_path / "cgroup").write_text("4:memory:/\n0::/user.slice/run.scope\n")
    found = Bound.detect(str(tmp_path / "mounts"), str(tmp_path / "cgroup"))
    assert found == Bound(2, scope, scope)
    (scope / "cgroup.controllers").write_text("cpu\n")
    assert Bound.detect(str(tmp_path / "mounts"), str(tmp_path / "cgroup")) == \
        "cgroup v2 without the memory and pids controllers here (not delegated); no cgroup v1 memory and pids controllers"


def test_reward_calls_at_once_fit_the_sandbox_memory(monkeypatch):
    """A group of six completions scored at once by a reward that runs code: no more runs at
    once than orchestrator.sandbox.memory_mb holds of their worst case."""
    from orchestrator.rewards.async_function import AsyncReward

    limits = Limits(wall_s=30, memory_mb=128, processes=4, total_mb=256)
    worst = limits.worst_mb(isinstance(sandbox._bound(), Bound))
    monkeypatch.setattr(sandbox_budget, "BUDGET", sandbox_budget.MemoryBudget(2 * worst))
    monkeypatch.setattr(sandbox, "BUDGET", sandbox_budget.BUDGET)
    box = Sandbox(limits)

    async def reward(prompt, completion, row):
        result = await box.run("import time\nprint(time.time())\ntime.sleep(1.5)\nprint(time.time())")
        return float(result.outcome == "ok")

    intervals = []

    async def scored():
        original = box.run

        async def timed(code, stdin=""):
            result = await original(code, stdin)
            intervals.append(tuple(map(float, result.stdout.split())))
            return result

        box.run = timed
        return await AsyncReward("runs code", 60.0, reward).score("p", ["c"] * 6, {})

    assert asyncio.run(scored()) == [1.0] * 6
    # From the programs' own clocks: how many ran at once.
    at_once = max(sum(s <= t < e for s, e in intervals) for t, _ in intervals)
    assert at_once <= 2, f"{at_once} runs of {worst} MB at once in a budget of {2 * worst} MB: {intervals}"
    assert sandbox_budget.BUDGET.most_running == 2


def test_the_config_gives_the_sandbox_its_memory(monkeypatch):
    from conftest import TINY_MODEL
    from orchestrator.rewards.registry import configured_rewards
    from rl.config import RunConfig

    monkeypatch.setattr(sandbox_budget.BUDGET, "limit_mb", sandbox_budget.BUDGET.limit_mb)
    cfg = RunConfig.model_validate({"model": str(TINY_MODEL), "orchestrator": {
        "datasets": [{"function": "tasks.coding:dataset", "reward": "tasks.coding:reward"}],
        "sandbox": {"memory_mb": 3000}}})
    configured_rewards(cfg, None)
    assert sandbox_budget.BUDGET.limit_mb == 3000
