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
  it counts this run's processes only); and a wall-clock timeout. cgroups are not used: most
  hosts (this one's cgroup v2 has no controllers) do not delegate them to an unprivileged user.
The interpreter is this one where bwrap's user can read it, else the system's /usr/bin/python3
(pyenv under /root, as root): the standard library is there, the project's packages are not.

Where bwrap is missing or cannot make namespaces (no unprivileged user namespaces) a run has the
limits only, in a scratch directory, killed by process group: `isolated` is False and
Sandbox.isolation() says why in one line. A run that executes code refuses to start on such a
machine unless its config says orchestrator.sandbox.isolation = "none" (orchestrator/preflight.py).

Output is read as it comes and kept up to `output_bytes` per stream; a run that writes more than
OUTPUT_FLOOD times that is killed (its output is not worth the time). Outcomes: "ok" (exit 0),
"error" (another exit code), "timeout" (wall clock), "cpu" (CPU seconds: SIGXCPU/SIGKILL from
the kernel), "memory" (MemoryError, or killed by the kernel's out-of-memory killer), "output"
(flooded), "killed" (another signal). bwrap reports a program killed by signal N as exit code
128 + N, read back as that signal: a program that itself exits with 129..159 reads as killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import json
import os
import platform
import resource
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from orchestrator.reporting import prometheus

SLOTS = range(61000, 61256)  # user ids of sandboxed runs as root (no account needs to exist)
SLOT_WAIT_S = 120.0  # all taken (more concurrent runs than SLOTS): wait this long for one
LOCKS = Path(tempfile.gettempdir()) / "asyncrl-sandbox"
OUTPUT_FLOOD = 64
EXIT_GRACE_S = 0.5  # output still arriving after the program exits, from what it started
INSIDE_ID = 65534  # the user and group a program sees itself as ("nobody")
INSTALL = "apt-get install bubblewrap"
# Syscalls a program has no business making (x86_64 numbers): ptrace and reading other processes'
# memory, keyrings, mounts and namespaces, bpf, perf, userfaultfd, io_uring, kernel modules and
# kexec, swap, reboot, clocks, accounting, quotas, file handles, the kernel log, I/O ports,
# anonymous memory files.
DENIED_X86_64 = (101, 310, 311, 312, 248, 249, 250, 165, 166, 155, 161, 272, 308, 321, 298, 323, 425, 426, 427,
                 175, 313, 176, 246, 320, 167, 168, 169, 163, 179, 103, 164, 227, 159, 305, 303, 304, 172, 173, 134,
                 428, 429, 430, 431, 432, 433, 442, 300, 212, 153,
                 319)  # memfd_create: memory bounded by no rlimit but the file size, times open files


@dataclass(frozen=True)
class Limits:
    wall_s: float = 10.0
    cpu_s: int = 5
    memory_mb: int = 512
    processes: int = 16
    scratch_mb: int = 64
    output_bytes: int = 16_384
    open_files: int = 64


@dataclass
class RunResult:
    stdout: str
    stderr: str
    exit_code: int | None
    outcome: str
    isolated: bool
    truncated: bool = False

    def for_model(self) -> str:
        """What a tool call answers: the output, and why it stopped when it did not end well."""
        text = self.stdout + (f"\n[stderr]\n{self.stderr}" if self.stderr.strip() else "")
        notes = {"timeout": "timed out", "cpu": "CPU time limit reached", "memory": "out of memory",
                 "output": "output limit reached: stopped", "killed": "killed", "error": f"exit code {self.exit_code}"}
        if self.truncated:
            text += "\n[output truncated]"
        return text + (f"\n[{notes[self.outcome]}]" if self.outcome in notes else "")


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
    def describe() -> str:
        """What a run gets, in a few words (logged at start-up)."""
        python, why = _probe()
        if why:
            return f"none ({why})"
        return (f"bubblewrap {_bwrap_version()}: user, PID, IPC, UTS, network and mount namespaces, "
                f"{'a seccomp filter, ' if _seccomp_filter() else 'no seccomp filter (not x86_64), '}"
                f"{os.path.realpath(python)}")

    async def run(self, code: str, stdin: str = "") -> RunResult:
        python, why = _probe() if self.mode != "none" else (None, "isolation none")
        if why and self.mode == "bwrap":
            raise RuntimeError(why)
        if python is None:
            with tempfile.TemporaryDirectory(prefix="sandbox-") as scratch:
                return await self._run([sys.executable, "-I", "-c", code], (), stdin, None, None, scratch)
        seccomp = _seccomp_pipe()
        info, info_w = os.pipe()  # bwrap writes the pid of its first process inside here
        os.set_blocking(info, False)
        try:
            argv = _bwrap_argv(python, self.limits, code, seccomp)
            argv[1:1] = ["--info-fd", str(info_w)]
            fds = (info_w,) if seccomp is None else (info_w, seccomp)
            if os.geteuid() != 0:
                return await self._run(argv, fds, stdin, None, info)
            async with _free_slot() as uid:
                return await self._run(argv, fds, stdin, uid, info)
        finally:
            for fd in (info, info_w) if seccomp is None else (info, info_w, seccomp):
                os.close(fd)

    async def _run(self, argv: list[str], fds: tuple[int, ...], stdin: str, uid: int | None, info: int | None,
                   scratch: str | None = None) -> RunResult:
        """`info`: bwrap's --info-fd, read end (isolated); `scratch`: the working directory (unisolated)."""
        lim, isolated = self.limits, scratch is None
        env = {"PATH": "/usr/bin:/bin", "HOME": scratch or "/tmp", "TMPDIR": scratch or "/tmp", "LANG": "C.UTF-8",
               "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env=env, cwd=scratch or "/", start_new_session=True, pass_fds=fds, preexec_fn=lambda: _confine(lim, uid))
        code_, stdout, stderr, timed_out, flooded, truncated = await _supervise(proc, lim, stdin)
        if info is not None:
            await _namespace_gone(info)
        if isolated and code_ is not None and 128 < code_ < 160:
            code_ = -(code_ - 128)  # bwrap's report of a program killed by that signal
        outcome = _outcome(code_, stderr, timed_out, flooded)
        prometheus.SANDBOX_RUNS.labels(outcome).inc()
        return RunResult(stdout, stderr, code_, outcome, isolated, truncated)


async def _supervise(proc: asyncio.subprocess.Process, lim: Limits, stdin: str):
    """Feeds stdin, reads both streams, enforces the wall clock and the output flood, and kills
    whatever is left: (exit code, stdout, stderr, timed out, flooded, truncated)."""

    def kill() -> None:
        _kill(proc.pid)

    out, err = _Capped(lim.output_bytes, kill), _Capped(lim.output_bytes, kill)
    drains = asyncio.ensure_future(asyncio.gather(out.drain(proc.stdout), err.drain(proc.stderr)))
    exited = asyncio.ensure_future(_exited(proc))
    timed_out = False
    try:
        async with asyncio.timeout(lim.wall_s):
            proc.stdin.write(stdin.encode())
            with contextlib.suppress(ConnectionError):
                await proc.stdin.drain()
            proc.stdin.close()
            await asyncio.wait({drains, exited}, return_when=asyncio.FIRST_COMPLETED)
            if not drains.done():  # it exited, and what it started holds the pipes open
                await asyncio.wait({drains}, timeout=EXIT_GRACE_S)
                kill()
            await drains
    except TimeoutError:
        timed_out = True
    finally:
        exited.cancel()
        kill()  # whatever it left behind
        # The pipes read to their end (every writer is dead now): asyncio's wait() returns
        # only once they are closed.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5.0):
                await drains
        with contextlib.suppress(ProcessLookupError):
            await proc.wait()
    return (proc.returncode, out.text(), err.text(), timed_out, out.flooded or err.flooded,
            out.truncated or err.truncated)


async def _namespace_gone(info: int) -> None:
    """Waits (5 s at most) until the run's PID namespace is empty: bwrap may exit (with the
    program's status) before its first process inside has, and the kernel lets that process exit
    only after every other process of the namespace. Its pid is what bwrap wrote on --info-fd
    (nothing if bwrap died before making it); a pidfd of it turns readable once it has exited."""
    try:
        pid = int(json.loads(os.read(info, 4096))["child-pid"])
        pidfd = os.pidfd_open(pid)
    except (OSError, ValueError, KeyError, TypeError):
        return  # never made, or gone already
    loop = asyncio.get_running_loop()
    gone = loop.create_future()
    loop.add_reader(pidfd, lambda: gone.done() or gone.set_result(None))
    try:
        async with asyncio.timeout(5.0):
            await gone
    except TimeoutError:
        pass
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)


async def _exited(proc: asyncio.subprocess.Process) -> None:
    """The program itself has exited (its return code is known), whoever still holds its pipes:
    asyncio's wait() would wait for those too."""
    while proc.returncode is None:
        await asyncio.sleep(0.05)


class _Capped:
    """A stream read to its end, its first `cap` bytes kept. Past OUTPUT_FLOOD times that it
    calls `flood` once (the run kills the program) and reads on to the end, discarding."""

    def __init__(self, cap: int, flood):
        self.cap, self.flood, self.data, self.seen, self.flooded = cap, flood, bytearray(), 0, False

    async def drain(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(65536):
            self.seen += len(chunk)
            if len(self.data) < self.cap:
                self.data += chunk[: self.cap - len(self.data)]
            if self.seen > OUTPUT_FLOOD * self.cap and not self.flooded:
                self.flooded = True
                self.flood()

    @property
    def truncated(self) -> bool:
        return self.seen > len(self.data)

    def text(self) -> str:
        return self.data.decode(errors="replace")


def _outcome(code: int | None, stderr: str, timed_out: bool, flooded: bool) -> str:
    if flooded:
        return "output"
    if timed_out:
        return "timeout"
    if code == 0:
        return "ok"
    if code in (-signal.SIGXCPU, -signal.SIGKILL) and "MemoryError" not in stderr:
        return "cpu" if code == -signal.SIGXCPU else "killed"
    if "MemoryError" in stderr:
        return "memory"
    return "error" if code is not None and code > 0 else "killed"


def _bwrap_argv(python: str, lim: Limits, code: str, seccomp: int | None) -> list[str]:
    """bwrap's command line for one run of `code`; `seccomp`: the filter's fd (_seccomp_pipe)."""
    argv = [_bwrap(), *(["--seccomp", str(seccomp)] if seccomp is not None else []),
            "--unshare-all", "--unshare-user", "--uid", str(INSIDE_ID), "--gid", str(INSIDE_ID),
            "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--hostname", "sandbox"]
    if "--disable-userns" in _bwrap_help():
        argv.append("--disable-userns")
    size = "--size" in _bwrap_help()
    argv += [*_interpreter_mounts(python), "--proc", "/proc", "--dev", "/dev",
             *(["--size", str(lim.scratch_mb * 2**20)] if size else []), "--tmpfs", "/tmp",
             *(["--size", str(2**20)] if size else []), "--tmpfs", "/dev/shm",
             # bwrap's / and /dev are tmpfs mounts without a size: read-only, they cannot fill memory
             "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/tmp",
             "--", _prlimit(), f"--nproc={lim.processes}", "--", os.path.realpath(python), "-I", "-c", code]
    return argv


def _interpreter_mounts(python: str) -> list[str]:
    """bwrap's arguments that show, read-only, the interpreter, its standard library, the shared
    libraries (the system's library directories) and prlimit, and nothing else of the host: no
    other program (no shell, no compiler), no site-packages. An interpreter outside /usr (pyenv)
    shows its whole prefix, its site-packages hidden under an empty read-only tmpfs."""
    real = os.path.realpath(python)
    prefix, stdlib, platstdlib, purelib, multiarch = _layout(real)
    args: list[str] = []
    bound = []  # top-level library directories of a /usr not merged, shown whole
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):  # a merged /usr: /lib -> usr/lib
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top) and top.startswith("/lib"):  # the loader and libraries, not /bin's programs
            args += ["--ro-bind", top, top]
            bound.append(top)
    shown = [prefix] if not real.startswith("/usr/") else [real, stdlib, platstdlib]
    libraries = [f"/usr/lib/{multiarch}" if multiarch else "/usr/lib", "/usr/lib64", "/usr/lib32"]
    for path in dict.fromkeys(os.path.realpath(p) for p in [*shown, *libraries, _prlimit()]):
        if os.path.exists(path) and not any(path.startswith(top + "/") for top in bound):
            args += ["--ro-bind", path, path]
    for packages in dict.fromkeys([purelib, os.path.join(stdlib, "site-packages")]):
        if os.path.isdir(packages) and any(packages.startswith(p.rstrip("/") + "/") for p in shown):
            args += ["--tmpfs", packages, "--remount-ro", packages]
    return args


@functools.cache
def _layout(python: str) -> tuple[str, str, str, str, str]:
    """(prefix, stdlib, platstdlib, purelib, multiarch) of an interpreter, asked of it (trusted
    code, run once, outside any sandbox)."""
    ask = ("import json, sys, sysconfig; p = sysconfig.get_paths(); print(json.dumps([sys.base_prefix, p['stdlib'], "
           "p['platstdlib'], p['purelib'], sysconfig.get_config_var('MULTIARCH') or '']))")
    return tuple(json.loads(subprocess.run([python, "-I", "-c", ask], capture_output=True, text=True, timeout=30,
                                           check=True).stdout))


@functools.cache
def _bwrap() -> str | None:
    return shutil.which("bwrap") or shutil.which("bwrap", path="/usr/bin:/bin:/usr/local/bin")


@functools.cache
def _prlimit() -> str | None:
    return shutil.which("prlimit", path="/usr/bin:/bin")


@functools.cache
def _bwrap_help() -> str:
    return subprocess.run([_bwrap(), "--help"], capture_output=True, text=True, timeout=30).stdout


@functools.cache
def _bwrap_version() -> str:
    return subprocess.run([_bwrap(), "--version"], capture_output=True, text=True, timeout=30).stdout.split()[-1]


@functools.cache
def _probe() -> tuple[str | None, str | None]:
    """(the interpreter isolated runs use, None), or (None, why runs cannot be isolated and the
    fix). Asked once, by running each candidate in bwrap as runs will."""
    if not sys.platform.startswith("linux"):
        return None, f"code runs without isolation on {sys.platform} (bubblewrap is Linux only): limits only"
    if _bwrap() is None:
        return None, f"bubblewrap not found: {INSTALL}"
    if _prlimit() is None:
        return None, "prlimit not found (util-linux): apt-get install util-linux"
    why = "no Python to run"
    # The real file: a virtual environment's python is a link, and its packages stay out of sight.
    for candidate in dict.fromkeys([os.path.realpath(sys.executable), "/usr/bin/python3"]):
        if os.path.exists(candidate):
            try:
                probe = _try(candidate)
            except (OSError, subprocess.SubprocessError) as e:
                why = str(e)
                continue
            if probe.stdout.strip() == "3":
                return candidate, None
            why = (probe.stderr.strip().splitlines() or [f"exit code {probe.returncode}"])[-1]
    return None, (f"bubblewrap cannot isolate runs here ({why}): it needs unprivileged user namespaces "
                  "(sysctl kernel.unprivileged_userns_clone=1, user.max_user_namespaces > 0; in a container, "
                  "a seccomp/AppArmor profile that allows them)")


def _try(python: str) -> subprocess.CompletedProcess:
    """`python` run in bwrap as runs are, printing its major version."""
    with _slot() if os.geteuid() == 0 else contextlib.nullcontext() as uid:
        seccomp = _seccomp_pipe()
        try:
            return subprocess.run(_bwrap_argv(python, Limits(), "import sys; print(sys.version_info[0])", seccomp),
                                  env={"PATH": "/usr/bin:/bin"}, timeout=30, capture_output=True, text=True,
                                  pass_fds=() if seccomp is None else (seccomp,),
                                  preexec_fn=lambda: _confine(Limits(), uid))
        finally:
            if seccomp is not None:
                os.close(seccomp)


@functools.cache
def _seccomp_filter() -> bytes:
    """A classic BPF program for bwrap --seccomp: another architecture or the x32 ABI is killed,
    DENIED_X86_64 answer EPERM, everything else is allowed. Empty (no filter) off x86_64."""
    if platform.machine() != "x86_64":
        return b""
    ld_abs, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    n = len(DENIED_X86_64)
    program = [(ld_abs, 0, 0, 4), (jeq, 1, 0, 0xC000003E), (ret, 0, 0, 0x80000000),  # arch: x86_64 or killed
               (ld_abs, 0, 0, 0), (jge, n + 2, 0, 0x40000000)]  # x32 syscalls: killed (KILL below)
    program += [(jeq, n - i, 0, nr) for i, nr in enumerate(DENIED_X86_64)]  # jump to EPERM
    program += [(ret, 0, 0, 0x7FFF0000), (ret, 0, 0, 0x00050000 | 1), (ret, 0, 0, 0x80000000)]
    return b"".join(struct.pack("=HBBI", *insn) for insn in program)


def _seccomp_pipe() -> int | None:
    """A pipe's read end holding the filter, for bwrap to read (and close) once; None without one."""
    if not _seccomp_filter():
        return None
    r, w = os.pipe()
    os.write(w, _seccomp_filter())  # a few hundred bytes: the pipe's buffer holds them
    os.close(w)
    return r


@contextlib.asynccontextmanager
async def _free_slot():
    """A user id no other run holds now, for the length of a run, waiting while all SLOTS are
    taken (at most SLOT_WAIT_S)."""
    deadline = asyncio.get_running_loop().time() + SLOT_WAIT_S
    while (taken := _take_slot()) is None:
        if asyncio.get_running_loop().time() > deadline:
            raise RuntimeError(f"all {len(SLOTS)} sandbox user ids stayed in use for {SLOT_WAIT_S:.0f} s")
        await asyncio.sleep(0.05)
    uid, lock = taken
    try:
        yield uid
    finally:
        os.close(lock)


@contextlib.contextmanager
def _slot():
    """_free_slot for a caller outside the event loop (the probe), without waiting."""
    taken = _take_slot()
    if taken is None:
        raise RuntimeError(f"all {len(SLOTS)} sandbox user ids are in use")
    try:
        yield taken[0]
    finally:
        os.close(taken[1])


def _take_slot() -> tuple[int, int] | None:
    """(uid, its lock's fd) for a user id no other run holds (flock on a file per id, so other
    processes' runs count too), or None. A holder that died left nothing running: its runs died
    with it (bwrap's --die-with-parent)."""
    LOCKS.mkdir(mode=0o700, exist_ok=True)
    for uid in SLOTS:
        fd = os.open(LOCKS / str(uid), os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return uid, fd
    return None


def _confine(lim: Limits, uid: int | None) -> None:
    """In the child, before exec (of bwrap, or of the interpreter unisolated): limits, then as
    root the run's own user id. Processes are limited inside bwrap (prlimit), where the count is
    this run's: here it would count every process of the user."""
    memory = lim.memory_mb * 2**20
    for which, value in ((resource.RLIMIT_CPU, lim.cpu_s), (resource.RLIMIT_AS, memory),
                         (resource.RLIMIT_FSIZE, lim.scratch_mb * 2**20), (resource.RLIMIT_NOFILE, lim.open_files),
                         (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(which, (value, value + 1 if which == resource.RLIMIT_CPU else value))
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)


def _kill(pid: int) -> None:
    """The run's process group: unisolated, the program and what did not leave the group;
    isolated, bwrap, whose first process inside dies with it (--die-with-parent), and with that
    process every other process of the PID namespace, those that called setsid included."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
