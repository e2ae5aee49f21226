"""What one sandboxed run can take from the host (issue 60's probe): tasks/coding.py's SANDBOX
(512 MB a process, 16 processes, 1024 MB in all) running code that forks to its process limit
with each child filling 450 MB, or filling loopback TCP buffers; and four fork-fills scored at
once, as a group of completions is. Measured: how far the host's MemAvailable falls below where
it stood (sampled every 20 ms), and the kernel's peak for each run's cgroup. As root; the table
in docs/tools.md.

    .venv/bin/python benchmarks/sandbox_total_memory.py
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

from orchestrator.sandbox.sandbox import Sandbox  # noqa: E402
from tasks.coding import SANDBOX  # noqa: E402
from test_sandbox_total import FORK_FILL, SOCKET_FILL  # noqa: E402  (the tests' probes, at full size)

CASES = [
    ("fork to the limit, each child filling 450 MB", FORK_FILL.replace("FILL_MB", "450").replace("HOLD_S", "5"), 1),
    ("fork to the limit, each child filling loopback TCP buffers", SOCKET_FILL.replace("HOLD_S", "5"), 1),
    ("four fork-fills at once (a group scored)", FORK_FILL.replace("FILL_MB", "450").replace("HOLD_S", "5"), 4),
]


def available_mb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def measure(code: str, runs: int) -> tuple[float, list, float]:
    """(how far MemAvailable fell, MB; the runs' results; seconds)."""
    before, lowest, done = available_mb(), [available_mb()], threading.Event()

    def sample():
        while not done.is_set():
            lowest[0] = min(lowest[0], available_mb())
            time.sleep(0.02)

    watcher = threading.Thread(target=sample)
    watcher.start()
    start = time.perf_counter()

    async def all_runs():
        return await asyncio.gather(*(SANDBOX.run(code) for _ in range(runs)))

    try:
        results = asyncio.run(all_runs())
    finally:
        done.set()
        watcher.join()
    return before - lowest[0], results, time.perf_counter() - start


def main() -> None:
    print(f"isolation: {Sandbox.describe()}")
    print("| case | host memory taken (MemAvailable's fall) | kernel's peak per run | outcome | stdout (forked, filled) | s |")
    print("|---|---|---|---|---|---|")
    for name, code, runs in CASES:
        fell, results, seconds = measure(code, runs)
        peaks = ", ".join(f"{r.peak_mb:.0f} MB" if r.peak_mb is not None else "-" for r in results)
        outcomes = ", ".join(sorted({r.outcome for r in results}))
        shown = "; ".join(r.stdout.strip() or "-" for r in results)
        print(f"| {name} | {fell:.0f} MB | {peaks} | {outcomes} | {shown} | {seconds:.1f} |")


if __name__ == "__main__":
    main()
