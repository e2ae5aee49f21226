"""A sandboxed run's total: one cgroup per run bounding the memory of all its processes together,
the kernel memory they cause included, and their number. rlimits cannot: RLIMIT_AS is per
process (16 processes of 512 MB are 8 GB) and no rlimit counts socket buffers, which the run can
fill on its own loopback (issue 60: 1.6 GB by 14 processes).

    bound = Bound.detect()                 # once: which cgroups this host gives, or why none
    group = bound.make(total_mb=1024, processes=16)
    ... start the run with preexec_fn calling group.join() (as root, before dropping to its user)
    group.peak_mb(), group.oom_killed(); group.remove()   # after the run

Where the host gives them:
- cgroup v2 delegated to this process (its own cgroup has the memory and pids controllers, and
  may enable them for children: a systemd scope with Delegate=yes): memory.max counts the run's
  pages, its kernel memory and its socket buffers, all in one figure; memory.swap.max = 0;
- cgroup v1's memory and pids hierarchies writable (as root): memory.limit_in_bytes counts pages
  and kernel memory (slab, page tables, pipes); TCP buffers are a counter of their own there
  (memory.kmem.tcp.*), given TCP_SHARE of the total, the rest to memory.limit_in_bytes, so that
  the two together stay within the total; memory.memsw.limit_in_bytes the same (no swap either).
pids.max is the run's processes plus bwrap's two (outside and its init inside). Past the memory
bound the kernel's OOM killer kills within the run only; the run reads it as "memory".
Otherwise: None, with why, and the run has its rlimits only (sandbox.py says so at start-up).
A run's group lies under this process's own cgroup (so a container's bound still holds above it);
groups left by a process that died (named for its pid) are removed by the next detect().
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

TCP_SHARE = 4  # cgroup v1: 1/TCP_SHARE of a run's total for its TCP buffers, the rest for the rest
BWRAP_PROCESSES = 2  # bwrap outside the namespaces and its init inside, beside the run's own
PREFIX = "asyncrl-sandbox-"
_serial = itertools.count()


@dataclass(frozen=True)
class Bound:
    """Where a run's cgroups go: `version` 1 (`memory` and `pids` directories, two hierarchies)
    or 2 (`memory` is `pids`: one directory)."""

    version: int
    memory: Path
    pids: Path

    @staticmethod
    def detect(mounts: str = "/proc/self/mounts", own: str = "/proc/self/cgroup") -> Bound | str:
        """The bound this host gives, or one line saying why none."""
        try:
            table = [line.split() for line in Path(mounts).read_text().splitlines()]
            groups = dict(line.split(":", 2)[1:] for line in Path(own).read_text().splitlines())
        except OSError as e:
            return f"cgroups unreadable ({e})"
        v2 = next((Path(m[1]) for m in table if m[2] == "cgroup2"), None)
        v2_why = "no cgroup v2 mount"
        if v2 is not None and "" in groups:
            here = v2 / groups[""].lstrip("/")
            v2_why = _delegated(here)
            if v2_why is None:
                return _cleaned(Bound(2, here, here))
        v1 = {opt: Path(m[1]) for m in table if m[2] == "cgroup" for opt in m[3].split(",")}
        if "memory" in v1 and "pids" in v1:
            memory = v1["memory"] / groups.get("memory", "/").lstrip("/")
            pids = v1["pids"] / groups.get("pids", "/").lstrip("/")
            if all(os.access(d, os.W_OK) for d in (memory, pids)) and (memory / "memory.kmem.tcp.limit_in_bytes").exists():
                return _cleaned(Bound(1, memory, pids))
            return f"{v2_why}; cgroup v1's memory and pids not writable by this user (as root they are)"
        return f"{v2_why}; no cgroup v1 memory and pids controllers"

    def describe(self, total_mb: int, processes: int) -> str:
        if self.version == 2:
            return (f"cgroup v2: {total_mb} MB for all its processes with their kernel memory and socket buffers, "
                    f"{processes} processes")
        return (f"cgroup v1: {total_mb} MB for all its processes with their kernel memory, TCP buffers "
                f"{total_mb // TCP_SHARE} MB of it; {processes} processes")

    def make(self, total_mb: int, processes: int) -> RunGroup:
        name = f"{PREFIX}{os.getpid()}-{next(_serial)}"
        group = RunGroup(self.version, self.memory / name, self.pids / name)
        try:
            group.memory.mkdir()
            if self.version == 1:
                group.pids.mkdir()
            group.limit(total_mb * 2**20, processes + BWRAP_PROCESSES)
        except BaseException:
            group.remove()
            raise
        return group


def _delegated(here: Path) -> str | None:
    """None where `here` (this process's cgroup v2) may hold children bounded in memory and pids."""
    try:
        controllers = (here / "cgroup.controllers").read_text().split()
    except OSError as e:
        return f"cgroup v2 unreadable ({e.strerror})"
    if not {"memory", "pids"} <= set(controllers):
        return "cgroup v2 without the memory and pids controllers here (not delegated)"
    if not os.access(here, os.W_OK):
        return "cgroup v2 not delegated to this user"
    control = here / "cgroup.subtree_control"
    if {"memory", "pids"} <= set(control.read_text().split()):
        return None
    try:  # fails while this process sits in `here` itself (no internal processes): then not ours to use
        control.write_text("+memory +pids")
    except OSError as e:
        return f"cgroup v2: cannot enable memory and pids for children ({e.strerror})"
    return None


def _cleaned(bound: Bound) -> Bound | str:
    """`bound`, its groups left by processes that died removed (empty: their runs died with them),
    once a group has been made and bounded there (a read-only mount, a container's policy: not)."""
    for top in {bound.memory, bound.pids}:
        for d in top.glob(f"{PREFIX}*"):
            with contextlib.suppress(ValueError, OSError):
                pid = int(d.name[len(PREFIX):].split("-")[0])
                if not Path(f"/proc/{pid}").exists():
                    d.rmdir()
    try:
        bound.make(64, 1).remove()
    except OSError as e:
        return f"cgroup v{bound.version} at {bound.memory}: cannot make a bounded group ({e.strerror})"
    return bound


@dataclass
class RunGroup:
    """One run's cgroup (v1: a directory in each of the two hierarchies)."""

    version: int
    memory: Path
    pids: Path

    def limit(self, total: int, processes: int) -> None:
        if self.version == 2:
            for name, value in (("memory.max", total), ("memory.swap.max", 0), ("pids.max", processes)):
                (self.memory / name).write_text(str(value))
            return
        tcp = total // TCP_SHARE
        for name, value in (("memory.limit_in_bytes", total - tcp), ("memory.memsw.limit_in_bytes", total - tcp),
                            ("memory.kmem.tcp.limit_in_bytes", tcp)):
            if (self.memory / name).exists():  # memsw: only with swap accounting
                (self.memory / name).write_text(str(value))
        (self.pids / "pids.max").write_text(str(processes))

    def join(self) -> None:
        """The calling process (the run's first, in its preexec, still root) into the group."""
        for d in {self.memory, self.pids}:
            with open(d / "cgroup.procs", "w") as f:
                f.write("0")  # "0": the writer itself

    def peak_mb(self) -> float | None:
        """The most the run held at once, as the kernel counted it (v1: pages and kernel memory,
        plus TCP buffers, each at its own peak)."""
        names = ("memory.peak",) if self.version == 2 else ("memory.max_usage_in_bytes",
                                                           "memory.kmem.tcp.max_usage_in_bytes")
        try:
            return sum(int((self.memory / n).read_text()) for n in names) / 2**20
        except (OSError, ValueError):
            return None

    def oom_killed(self) -> bool:
        """The kernel's OOM killer killed a process of the run (it reached its memory bound)."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            fields = dict(line.split() for line in (self.memory / name).read_text().splitlines())
        except (OSError, ValueError):
            return False
        return int(fields.get("oom_kill", 0)) > 0

    def remove(self) -> None:
        """Kills what is left in the group (nothing, normally: the run's namespace is empty by now)
        and removes it, trying for a second (a process just killed leaves the group when reaped)."""
        for _ in range(100):
            left = []
            for d in {self.memory, self.pids}:
                with contextlib.suppress(OSError):
                    left += [int(p) for p in (d / "cgroup.procs").read_text().split()]
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            try:
                for d in {self.memory, self.pids}:
                    if d.exists():
                        d.rmdir()
                return
            except OSError:
                time.sleep(0.01)
