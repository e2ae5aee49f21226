"""The sandbox (orchestrator/sandbox/sandbox.py) against hostile code: each case's outcome, time, and what
was left running afterwards; then what isolation costs: the time of one run of a trivial program
and runs per second (sequential, and CONCURRENT at once), with bubblewrap and without (limits
only). The tables in docs/tools.md.

    .venv/bin/python benchmarks/sandbox_cases.py             # both tables
    .venv/bin/python benchmarks/sandbox_cases.py --cost      # the cost only
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from orchestrator.sandbox.sandbox import SLOTS, Limits, Sandbox  # noqa: E402

CASES = [
    ("infinite loop", "while True: pass", {}),
    ("sleep past the clock", "import time; time.sleep(60)", {}),
    ("fork bomb (children setsid)", "import os\nwhile True:\n    if os.fork() == 0:\n        os.setsid()\n"
     "        import time; time.sleep(600)", {}),
    ("memory hog (2 GiB)", "x = bytearray(2 * 1024**3)", {}),
    ("write /etc, ~, the repo", f"for p in ('/etc/x', '{Path.home()}/x', '{Path(__file__).resolve().parents[1]}/x'):\n"
     "    try:\n        open(p, 'w')\n"
     "    except OSError as e:\n        print(p, e.strerror)", {}),
    ("fill the scratch disk", "open('big', 'wb').write(b'0' * 200 * 2**20)", {}),
    ("network (loopback, internet)", "import socket\nfor h in ('127.0.0.1', '1.1.1.1'):\n    try:\n"
     "        socket.create_connection((h, 80), timeout=2)\n    except OSError as e:\n        print(h, e.strerror)", {}),
    ("100 kB of output", "print('x' * 100_000)", {}),
    ("endless output", "while True: print('y' * 10_000)", {}),
]


def alive(uids) -> int:
    n = 0
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                status = (proc / "status").read_text()
            except OSError:
                continue
            if int(status.split("\nUid:\t")[1].split()[0]) in uids and "\nState:\tZ" not in status:
                n += 1
    return n


RUNS, CONCURRENT = 40, 8


async def _timed(box: Sandbox, code: str) -> float:
    start = time.perf_counter()
    result = await box.run(code)
    assert result.outcome == "ok", result
    return time.perf_counter() - start


async def _cost(code: str) -> dict[str, tuple[float, float, float]]:
    """Per isolation ("none", "auto"): (median seconds of one run, runs per second one after
    another, runs per second CONCURRENT at once). The two alternate, run by run and round by
    round, so that whatever else the machine does weighs on both alike."""
    boxes = {mode: Sandbox(Limits(), isolation=mode) for mode in ("none", "auto")}
    times = {mode: [] for mode in boxes}
    rounds = {mode: 0.0 for mode in boxes}
    for box in boxes.values():
        await _timed(box, code)  # warm: the probe, the page cache
    for _ in range(RUNS):
        for mode, box in boxes.items():
            times[mode].append(await _timed(box, code))
    for _ in range(RUNS // CONCURRENT):
        for mode, box in boxes.items():
            start = time.perf_counter()
            await asyncio.gather(*(_timed(box, code) for _ in range(CONCURRENT)))
            rounds[mode] += time.perf_counter() - start
    done = RUNS // CONCURRENT * CONCURRENT
    return {mode: (statistics.median(times[mode]), RUNS / sum(times[mode]), done / rounds[mode]) for mode in boxes}


def cost() -> None:
    from orchestrator.sandbox import sandbox

    print(f"isolation: {Sandbox.describe()}")
    # Both sides on the interpreter isolated runs use (the system's, as root): unisolated runs
    # start sys.executable, whose start-up time may differ (pyenv's: ~4x here).
    sys.executable = sandbox._probe()[0] or sys.executable
    print(f"| program | isolation | ms per run (median of {RUNS}) | runs/s one at a time | runs/s {CONCURRENT} at once |")
    print("|---|---|---|---|---|")
    for what, code in (("`pass`", "pass"), ("`import json, re, collections`", "import json, re, collections")):
        for mode, (median, seq, par) in asyncio.run(_cost(code)).items():
            name = "limits only" if mode == "none" else "bubblewrap"
            print(f"| {what} | {name} | {median * 1000:.1f} | {seq:.0f} | {par:.0f} |")


def cases() -> None:
    limits = Limits()
    print(f"isolation: {Sandbox.describe()}; {limits}")
    print("| case | outcome | exit | seconds | what the model reads (last line) | left running |")
    print("|---|---|---|---|---|---|")
    for name, code, kw in CASES:
        start = time.monotonic()
        r = asyncio.run(Sandbox(Limits(**kw)).run(code))
        seconds = time.monotonic() - start
        last = r.for_model().strip().splitlines()[-1][:70] if r.for_model().strip() else ""
        print(f"| {name} | {r.outcome} | {r.exit_code} | {seconds:.1f} | `{last}` | {alive(SLOTS)} |")


if __name__ == "__main__":
    if "--cost" not in sys.argv:
        cases()
    cost()
