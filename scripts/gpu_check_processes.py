"""The GPU check's processes (scripts/gpu_check.py): each item's process tree, its peak memory
(RSS from /proc, GPU memory from nvidia-smi), and what an item leaves running, stopped before
the next starts."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

# --- the item's processes: memory and clean-up ------------------------------------------------


def nvidia_smi(*query: str) -> list[list[str]] | None:
    """Rows of an nvidia-smi CSV query; None where nvidia-smi is missing or fails."""
    try:
        out = subprocess.run(["nvidia-smi", *query, "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return [[c.strip() for c in line.split(",")] for line in out.stdout.splitlines() if line.strip()]


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (servers start sessions of their own; they stay below)."""
    todo, seen = children(pid), []
    while todo:
        p = todo.pop()
        seen.append(p)
        todo += children(p)
    return seen


def rss_mib(pids: list[int]) -> float:
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for p in pids:
        try:
            total += int(Path(f"/proc/{p}/statm").read_text().split()[1]) * page
        except (OSError, IndexError, ValueError):
            pass
    return total / 2**20


def gpu_mib(pids: list[int]) -> float | None:
    """GPU memory held by `pids` (nvidia-smi's compute apps). In a container whose pids nvidia-smi
    does not see, none match: then every compute app counts (the check assumes the GPUs are its own)."""
    rows = nvidia_smi("--query-compute-apps=pid,used_memory")
    if rows is None:
        return None
    used = {int(r[0]): float(r[1]) for r in rows if len(r) == 2 and r[0].isdigit() and r[1].replace(".", "").isdigit()}
    mine = [m for p, m in used.items() if p in set(pids)]
    return sum(mine) if mine else sum(used.values())


class PeakMemory(threading.Thread):
    """Samples the memory of every process below this one (the item's child and what it started)
    until stopped: RSS every 0.5 s, GPU memory every second or so (nvidia-smi is slow)."""

    def __init__(self, gpu: bool):
        super().__init__(daemon=True)
        self.gpu, self.rss, self.gpu_peak = gpu, 0.0, None
        self.done = threading.Event()

    def run(self) -> None:
        tick = 0
        while not self.done.wait(0.5):
            pids = descendants(os.getpid())
            self.rss = max(self.rss, rss_mib(pids))
            tick += 1
            if self.gpu and tick % 2 == 0:
                used = gpu_mib(pids)
                if used is not None:
                    self.gpu_peak = max(self.gpu_peak or 0.0, used)

    def stop(self) -> None:
        self.done.set()
        self.join()


def become_subreaper() -> None:
    """Processes an item's child leaves behind (its servers, when the child is killed on timeout)
    become this process's children rather than init's, so clean_up() finds and kills them."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass  # not Linux: a killed child's servers may outlive it


def clean_up() -> None:
    """Kill and reap whatever is still running below this process (only after the child was
    waited for: reaping any pid must not steal its exit status)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        left = descendants(os.getpid())
        for p in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        if not left:
            return
        time.sleep(0.1)
