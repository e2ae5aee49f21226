"""CPU and memory of each asyncrl program's processes while a benchmark runs `rl run`: a thread
reads /proc every `every_s` for the process tree under the launcher, groups the processes by the
program (`rl inference`, `rl orchestrator`, `rl trainer`; with split_engine, the inference
server's engine core, a child process, apart as "engine"), and keeps each one's peak PSS and CPU
seconds.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

PROGRAMS = ("inference", "orchestrator", "trainer")


class Sampler(threading.Thread):
    """Peak PSS and CPU seconds of each program's process tree, every `every_s`."""

    def __init__(self, root_pid: int, every_s: float = 0.25, split_engine: bool = False):
        super().__init__(daemon=True)
        self.root_pid, self.every_s, self.split_engine = root_pid, every_s, split_engine
        self.keys = PROGRAMS + (("engine",) if split_engine else ())
        self.peak_pss = {p: 0 for p in self.keys}
        self.cpu_s = {p: 0.0 for p in self.keys}
        self.seen_cpu: dict[int, tuple[str, float]] = {}  # pid -> (program, its latest CPU seconds)
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.sample()
            self.stop.wait(self.every_s)

    def sample(self) -> None:
        children = children_of()
        pss = {p: 0 for p in self.keys}
        for top in children.get(self.root_pid, []):
            program = program_of(top)
            if program is None:
                continue
            for pid in process_tree(top, children):
                stat = process_stat(pid)
                if stat is None:
                    continue
                key = "engine" if self.split_engine and program == "inference" and pid != top else program
                pss[key] += stat[0]
                self.seen_cpu[pid] = (key, stat[1])
        for p in self.keys:
            self.peak_pss[p] = max(self.peak_pss[p], pss[p])
            self.cpu_s[p] = sum(cpu for prog, cpu in self.seen_cpu.values() if prog == p)


def children_of() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            out.setdefault(ppid, []).append(int(d.name))
    return out


def process_tree(pid: int, children: dict[int, list[int]]) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def program_of(pid: int) -> str | None:
    try:
        argv = (Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"))
    except OSError:
        return None
    words = [a.decode(errors="replace") for a in argv]
    return next((p for p in PROGRAMS if p in words), None)


def process_stat(pid: int) -> tuple[int, float] | None:
    """(PSS bytes, CPU seconds user + system) of one process. PSS, not RSS: the engine core is
    forked from the server and shares its pages (torch, vLLM), which RSS would count twice."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    pss_kb = next((int(line.split()[1]) for line in rollup.splitlines() if line.startswith("Pss:")), 0)
    return pss_kb * 1024, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
