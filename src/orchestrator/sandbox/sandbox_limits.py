"""What one sandboxed run may use, and the rlimits that hold it in the run's first process."""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    wall_s: float = 10.0
    cpu_s: int = 5
    memory_mb: int = 512
    """Address space of each process (RLIMIT_AS)."""
    processes: int = 16
    scratch_mb: int = 64
    output_bytes: int = 16_384
    open_files: int = 64
    total_mb: int = 1024
    """Memory of all the run's processes together, with the kernel memory they cause (socket
    buffers, page tables): held where the host gives cgroups (sandbox_cgroup.py), else only
    memory_mb x processes holds."""

    def worst_mb(self, cgroup: bool) -> int:
        """The most the run can hold: its total under a cgroup, else each process's address space."""
        return self.total_mb if cgroup else self.memory_mb * self.processes


def confine(lim: Limits, uid: int | None, group=None) -> None:
    """In the child, before exec (of bwrap, or of the interpreter unisolated): into the run's
    cgroup (`group`, sandbox_cgroup.RunGroup, while still root), limits, then as root the run's
    own user id. Processes are limited inside bwrap (prlimit), where the count is this run's:
    here it would count every process of the user."""
    if group is not None:
        group.join()
    memory = lim.memory_mb * 2**20
    for which, value in ((resource.RLIMIT_CPU, lim.cpu_s), (resource.RLIMIT_AS, memory),
                         (resource.RLIMIT_FSIZE, lim.scratch_mb * 2**20), (resource.RLIMIT_NOFILE, lim.open_files),
                         (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(which, (value, value + 1 if which == resource.RLIMIT_CPU else value))
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
