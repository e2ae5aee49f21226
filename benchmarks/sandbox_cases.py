"""The sandbox (orchestrator/sandbox.py) against hostile code: each case's outcome, time, and what
was left running afterwards; the table in docs/tools.md.

    .venv/bin/python benchmarks/sandbox_cases.py
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from orchestrator.sandbox import SLOTS, Limits, Sandbox  # noqa: E402

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


def main() -> None:
    limits = Limits()
    print(f"isolation: {Sandbox.isolation() or 'namespaces + a user id of its own'}; {limits}")
    print("| case | outcome | exit | seconds | what the model reads (last line) | left running |")
    print("|---|---|---|---|---|---|")
    for name, code, kw in CASES:
        start = time.monotonic()
        r = asyncio.run(Sandbox(Limits(**kw)).run(code))
        seconds = time.monotonic() - start
        last = r.for_model().strip().splitlines()[-1][:70] if r.for_model().strip() else ""
        print(f"| {name} | {r.outcome} | {r.exit_code} | {seconds:.1f} | `{last}` | {alive(SLOTS)} |")


if __name__ == "__main__":
    main()
