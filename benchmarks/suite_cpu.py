"""Where the test suite's CPU goes, per test file: run beside `make test` (pytest-xdist).

    python benchmarks/suite_cpu.py --out cpu.json &   # then: make test; then stop it (Ctrl-C)

Every second it reads every process's CPU time (psutil) and charges what each used since the
last look to the test file its xdist worker runs now (the worker's process title, "[pytest-xdist
running] tests/...", set by xdist), found by walking up the process's parents to a worker. The
engines and programs a test starts are its worker's descendants while they live; a process
orphaned by a kill is charged to "(orphaned)". Wall time alone hides this: the suite is CPU-bound
where engines start and train, idle where tests wait on timeouts, and more workers do not help
the first (docs/performance.md, "Test suite").
"""

from __future__ import annotations

import argparse
import json
import signal
import time
from collections import Counter

import psutil

RUNNING = "[pytest-xdist running] "


def test_file(title: str) -> str | None:
    if not title.startswith(RUNNING):
        return None
    return title[len(RUNNING):].split("::", 1)[0]


def owner(pid: int, parent: dict[int, int], workers: dict[int, str]) -> str:
    """The test file of the xdist worker `pid` descends from, or "(orphaned)" / "(other)"."""
    while pid in parent:
        if pid in workers:
            return workers[pid]
        if parent[pid] == 1:
            return "(orphaned)"
        pid = parent[pid]
    return "(other)"


def sample(seen: dict[int, float], charged: Counter, held: Counter, every: float) -> None:
    """Charge the CPU each process used since the last look; and `every` seconds of wall time
    to each file a worker is running now (how long the file held its worker)."""
    procs = list(psutil.process_iter(["ppid", "cmdline", "cpu_times"]))
    parent = {p.pid: p.info["ppid"] for p in procs}
    workers = {p.pid: name for p in procs if (name := test_file(" ".join(p.info["cmdline"] or [])))}
    for name in workers.values():
        held[name] += every
    for p in procs:
        t = p.info["cpu_times"]
        if t is None:
            continue
        total = t.user + t.system
        used = total - seen.get(p.pid, 0.0)
        seen[p.pid] = total
        if used > 0:
            charged[owner(p.pid, parent, workers)] += used


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file: CPU seconds per test file")
    parser.add_argument("--every", type=float, default=1.0)
    args = parser.parse_args()
    seen: dict[int, float] = {p.pid: sum(p.cpu_times()[:2]) for p in psutil.process_iter()}
    charged: Counter = Counter()
    held: Counter = Counter()
    stop = []
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    start = time.monotonic()
    while not stop:
        sample(seen, charged, held, args.every)
        time.sleep(args.every)
    wall = time.monotonic() - start
    result = {"wall_s": round(wall, 1), "cpu_s": {k: round(v, 1) for k, v in charged.most_common()},
              "worker_s": {k: round(v, 1) for k, v in held.most_common()}}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{wall:.0f} s wall; per test file, CPU seconds and seconds it held its worker:")
    for name, cpu in charged.most_common(25):
        print(f"{cpu:8.1f} {held.get(name, 0):8.0f}  {name}")


if __name__ == "__main__":
    main()
