"""No vLLM process outlives the server it belongs to.

When `rl inference` dies without cleaning up (SIGKILL, the OOM killer), vLLM's engine core
runs on: it waits on its input socket forever, holding memory, cores or GPUs, and a restarted
server on the same devices fails or crawls (measured: the engine core and its worker were still
there 20 s after the server was SIGKILLed). vLLM's workers watch their parent, the engine core;
nothing watches the server.

So `rl inference` starts a watchdog first: a small process that keeps a list of the server's
descendants (from /proc, once a second) and, once the server is gone, kills those still
running. Processes are recognised by pid and start time, so a recycled pid is never hit.
Linux only (/proc); elsewhere the watchdog is not started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

POLL_S = 1.0


def start() -> subprocess.Popen | None:
    """In the server process, before the engine starts."""
    if not Path("/proc/self/stat").exists():
        return None
    return subprocess.Popen([sys.executable, "-m", "inference.orphans", str(os.getpid())],
                            stdin=subprocess.DEVNULL)


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time) of a live process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # the command name may hold spaces and ")"
    return int(fields[1]), int(fields[19])


def descendants(root: int) -> dict[int, int]:
    """{pid: start time} of every process below `root`."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (st := _stat(int(entry.name))) is not None:
            children.setdefault(st[0], []).append(int(entry.name))
            starts[int(entry.name)] = st[1]
    found, todo = {}, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found[pid] = starts[pid]
        todo += children.get(pid, [])
    return found


def watch(server: int) -> None:
    me = os.getpid()
    known: dict[int, int] = {}
    # The server's exit re-parents this process at once (even before anyone reaps the server).
    while os.getppid() == server:
        known = {pid: t for pid, t in descendants(server).items() if pid != me}
        time.sleep(POLL_S)
    for pid, started in known.items():
        st = _stat(pid)
        if st is not None and st[1] == started:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's to handle
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # so is a group SIGTERM: act once it is gone
    watch(int(sys.argv[1]))
