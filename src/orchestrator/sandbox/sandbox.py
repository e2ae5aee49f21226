"""Running model-written Python: a subprocess with limits, cut off from the network, from the
machine's processes and from every file but the interpreter's own, and nothing of it left
running afterwards.

    result = await Sandbox(Limits(wall_s=10)).run("print(sum(range(10)))")
    result.stdout, result.outcome                      # "45\n", "ok"

Isolation comes from bubblewrap (`bwrap`, the Flatpak sandbox; `apt-get install bubblewrap`), not
from namespaces set up here, and is the same whoever runs it: as root a run first becomes a user
id of its own (one of a pool of SLOTS; a lock file per id keeps two runs, of this process or
another, off the same one), so bwrap always runs unprivileged, through a user namespace. Each
run gets:
- new user, PID, IPC, UTS, network, mount and cgroup namespaces: its processes see only each
  other (/proc is its own), its System V and POSIX IPC objects die with it, its network is a
  loopback of its own (nothing of the host's, abstract unix sockets included), and its processes
  all die with the namespace's first process, which dies with the run (--die-with-parent):
  `run` returns once the namespace is empty;
- a filesystem of the interpreter, its standard library, the system's shared libraries and
  prlimit, read-only (no other program, no site-packages: an interpreter outside /usr shows its
  prefix with site-packages hidden), a fresh /proc and /dev, / and /dev read-only, and
  tmpfs /tmp (its working directory, `scratch_mb`) and /dev/shm (1 MB): nothing of the
  repository, the run directory or the home directories; no descriptor but stdin, stdout, stderr;
- no capabilities, no_new_privs (setuid binaries do not elevate), no further user namespaces,
  and a seccomp filter (x86_64) that refuses ptrace, keyrings, mounts, bpf, perf, io_uring,
  kernel modules, clock changes and memfd_create with EPERM;
- limits: CPU seconds, address space, file size, open files, no core dumps (setrlimit before
  bwrap), processes (RLIMIT_NPROC, set inside the user namespace by util-linux's prlimit, where
  it counts this run's processes only); and a wall-clock timeout;
- a total: where the host gives cgroups (v2 delegated, or v1 as root), a cgroup of its own bounds
  the memory of all its processes together, with the kernel memory they cause (socket buffers),
  and their number (sandbox_cgroup.py); elsewhere only the rlimits hold (memory_mb x processes),
  and describe() says which;
- room: all runs of this process at once fit orchestrator.sandbox.memory_mb (sandbox_budget.py).
The interpreter is this one where bwrap's user can read it, else the system's /usr/bin/python3
(pyenv under /root, as root): the standard library is there, the project's packages are not.

Where bwrap is missing or cannot make namespaces (no unprivileged user namespaces) a run has the
limits only, in a scratch directory, killed by process group: `isolated` is False and
Sandbox.isolation() says why in one line. A run that executes code refuses to start on such a
machine unless its config says orchestrator.sandbox.isolation = "none" (orchestrator/preflight.py).

Output is read as it comes and kept up to `output_bytes` per stream; a run that writes more than
OUTPUT_FLOOD times that is killed (its output is not worth the time). Outcomes: "ok" (exit 0),
"error" (another exit code), "timeout" (wall clock), "cpu" (CPU seconds: SIGXCPU/SIGKILL from
the kernel), "memory" (MemoryError, or a process killed at the cgroup's bound), "output"
(flooded), "killed" (another signal). bwrap reports a program killed by signal N as exit code
128 + N, read back as that signal: a program that itself exits with 129..159 reads as killed.

The parts, each in its own file beside this one: sandbox_limits.py (Limits, rlimits),
sandbox_bwrap.py (the command line, seccomp, the probe), sandbox_users.py (user ids as root),
sandbox_cgroup.py (the run's total), sandbox_budget.py (runs at once), sandbox_supervise.py
(output, clock, outcome).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from orchestrator.sandbox.sandbox_budget import BUDGET
from orchestrator.sandbox.sandbox_bwrap import bwrap_argv, bwrap_version, seccomp_filter, seccomp_pipe
from orchestrator.sandbox.sandbox_bwrap import probe as _probe
from orchestrator.sandbox.sandbox_cgroup import Bound, RunGroup
from orchestrator.sandbox.sandbox_limits import Limits, confine
from orchestrator.sandbox.sandbox_supervise import namespace_gone, outcome_of, supervise
from orchestrator.sandbox.sandbox_users import SLOTS, free_slot

__all__ = ["SLOTS", "Limits", "RunResult", "Sandbox", "OUTCOME_LISTENERS"]

# Who hears each run's outcome: the orchestrator's Prometheus counter (orchestrator/main.py adds
# it). A list rather than an import, so that the sandbox's modules import nothing of the
# orchestrator and run alone: tests/orchestrator/test_sandbox_hostile.py runs a copy of them as nobody.
OUTCOME_LISTENERS: list = []


@dataclass
class RunResult:
    stdout: str
    stderr: str
    exit_code: int | None
    outcome: str
    isolated: bool
    truncated: bool = False
    peak_mb: float | None = None
    """The most the run held at once, as its cgroup counted it; None without one."""

    def for_model(self) -> str:
        """What a tool call answers: the output, and why it stopped when it did not end well."""
        text = self.stdout + (f"\n[stderr]\n{self.stderr}" if self.stderr.strip() else "")
        notes = {"timeout": "timed out", "cpu": "CPU time limit reached", "memory": "out of memory",
                 "output": "output limit reached: stopped", "killed": "killed", "error": f"exit code {self.exit_code}"}
        if self.truncated:
            text += "\n[output truncated]"
        return text + (f"\n[{notes[self.outcome]}]" if self.outcome in notes else "")


@functools.cache
def _bound() -> Bound | str:
    return Bound.detect()


class Sandbox:
    """`isolation`: "auto" (bwrap where it works, else limits only, as isolation() says), "bwrap"
    (refuses to run without it: RuntimeError) or "none" (limits only: for measuring the cost)."""

    def __init__(self, limits: Limits = Limits(), isolation: str = "auto"):
        if isolation not in ("auto", "bwrap", "none"):
            raise ValueError(f"isolation {isolation!r}: not auto, bwrap or none")
        self.limits, self.mode = limits, isolation

    @staticmethod
    def isolation() -> str | None:
        """None where runs are isolated; else one line saying what they lack, why, and the fix."""
        return _probe()[1]

    @staticmethod
    def total(limits: Limits = Limits()) -> str:
        """Which bound holds a run's total memory and processes here, in a few words."""
        bound = _bound()
        if isinstance(bound, Bound):
            return bound.describe(limits.total_mb, limits.processes)
        return (f"rlimits only ({limits.memory_mb} MB a process x {limits.processes} processes, "
                f"kernel memory unbounded): {bound}")

    @staticmethod
    def describe() -> str:
        """What a run gets, in a few words (logged at start-up)."""
        python, why = _probe()
        total = f"run total: {Sandbox.total()}; runs at once within {BUDGET.limit_mb} MB"
        if why:
            return f"none ({why}); {total}"
        return (f"bubblewrap {bwrap_version()}: user, PID, IPC, UTS, network and mount namespaces, "
                f"{'a seccomp filter, ' if seccomp_filter() else 'no seccomp filter (not x86_64), '}"
                f"{os.path.realpath(python)}; {total}")

    async def run(self, code: str, stdin: str = "") -> RunResult:
        python, why = _probe() if self.mode != "none" else (None, "isolation none")
        if why and self.mode == "bwrap":
            raise RuntimeError(why)
        bound = _bound()
        async with BUDGET.hold(self.limits.worst_mb(isinstance(bound, Bound))):
            group = bound.make(self.limits.total_mb, self.limits.processes) if isinstance(bound, Bound) else None
            try:
                if python is None:
                    with tempfile.TemporaryDirectory(prefix="sandbox-") as scratch:
                        return await self._run([sys.executable, "-I", "-c", code], (), stdin, None, None, group,
                                               scratch)
                return await self._isolated(python, code, stdin, group)
            finally:
                if group is not None:
                    group.remove()

    async def _isolated(self, python: str, code: str, stdin: str, group: RunGroup | None) -> RunResult:
        seccomp = seccomp_pipe()
        info, info_w = os.pipe()  # bwrap writes the pid of its first process inside here
        os.set_blocking(info, False)
        try:
            argv = bwrap_argv(python, self.limits, code, seccomp)
            argv[1:1] = ["--info-fd", str(info_w)]
            fds = (info_w,) if seccomp is None else (info_w, seccomp)
            if os.geteuid() != 0:
                return await self._run(argv, fds, stdin, None, info, group)
            async with free_slot() as uid:
                return await self._run(argv, fds, stdin, uid, info, group)
        finally:
            for fd in (info, info_w) if seccomp is None else (info, info_w, seccomp):
                os.close(fd)

    async def _run(self, argv: list[str], fds: tuple[int, ...], stdin: str, uid: int | None, info: int | None,
                   group: RunGroup | None, scratch: str | None = None) -> RunResult:
        """`info`: bwrap's --info-fd, read end (isolated); `scratch`: the working directory (unisolated)."""
        lim, isolated = self.limits, scratch is None
        env = {"PATH": "/usr/bin:/bin", "HOME": scratch or "/tmp", "TMPDIR": scratch or "/tmp", "LANG": "C.UTF-8",
               "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}
        # Popen, not an asyncio subprocess: sandbox_supervise.py says why. No await lies between
        # the start and the try, so a cancellation always finds the run in supervise's hands.
        proc = subprocess.Popen(argv, bufsize=0, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=env, cwd=scratch or "/", start_new_session=True,
                                pass_fds=fds, preexec_fn=lambda: confine(lim, uid, group))
        try:
            code_, stdout, stderr, timed_out, flooded, truncated = await supervise(proc, lim, stdin)
        finally:
            if info is not None:
                await namespace_gone(info)
        if isolated and code_ is not None and 128 < code_ < 160:
            code_ = -(code_ - 128)  # bwrap's report of a program killed by that signal
        oom = group is not None and group.oom_killed()
        outcome = outcome_of(code_, stderr, timed_out, flooded, oom)
        for hear in OUTCOME_LISTENERS:
            hear(outcome)
        return RunResult(stdout, stderr, code_, outcome, isolated, truncated,
                         group.peak_mb() if group is not None else None)
