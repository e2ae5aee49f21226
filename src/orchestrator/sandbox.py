"""Running model-written Python: a subprocess with limits, cut off from the network and from
every file but its own scratch directory, and nothing of it left running afterwards.

    result = await Sandbox(Limits(wall_s=10)).run("print(sum(range(10)))")
    result.stdout, result.outcome                      # "45\n", "ok"

Where the machine allows it (root on Linux, the usual case in a container), each run gets:
- new mount and network namespaces (Linux `unshare`): the network is a loopback that is down
  ("Network is unreachable"); / is read-only; /tmp, the working directory, and /dev/shm are fresh
  tmpfs mounts of `scratch_mb` and 1 MB, gone with the run;
- a user id of its own (one of a pool of SLOTS; a lock file per id keeps two runs, of this
  process or another, off the same one), so that afterwards a `kill(-1, SIGKILL)` as that user
  reaches every process it started, those that called setsid or double-forked included;
- limits (setrlimit): CPU seconds, address space, processes of its user (a fork bomb runs out
  of them), file size, open files, no core dumps; and a wall-clock timeout.
The interpreter is this one, or the system's where this one lies under a directory only root may
enter (pyenv in /root): the stdlib is there, the project's packages are not meant to be. Elsewhere
(not root, no namespaces) it runs with the limits it can set, in a scratch directory,
killed by process group, and `isolated` is False: a caller that needs isolation checks it
(Sandbox.isolation() says which at start-up).

Output is read as it comes and kept up to `output_bytes` per stream; a run that writes more than
OUTPUT_FLOOD times that is killed (its output is not worth the time). Outcomes: "ok" (exit 0),
"error" (another exit code), "timeout" (wall clock), "cpu" (CPU seconds: SIGXCPU/SIGKILL from
the kernel), "memory" (MemoryError, or killed by the kernel's out-of-memory killer), "output"
(flooded), "killed" (another signal).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import functools
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

SLOTS = range(61000, 61256)  # user ids of sandboxed runs (no account needs to exist)
SLOT_WAIT_S = 120.0  # all taken (more concurrent runs than SLOTS): wait this long for one
LOCKS = Path(tempfile.gettempdir()) / "asyncrl-sandbox"
OUTPUT_FLOOD = 64
EXIT_GRACE_S = 0.5  # output still arriving after the program exits, from what it started
CLONE_NEWNS, CLONE_NEWNET = 0x00020000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18


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


_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def _mount(source: bytes, target: bytes, fstype: bytes | None, flags: int, data: bytes | None) -> None:
    if _libc.mount(source, target, fstype, flags, data) != 0:
        raise OSError(ctypes.get_errno(), f"mount {target.decode()}")


class Sandbox:
    def __init__(self, limits: Limits = Limits()):
        self.limits = limits

    @staticmethod
    def isolation() -> str | None:
        """None where runs are isolated; else one line saying what they lack and why."""
        if _libc is None:
            return f"code runs without isolation on {sys.platform} (limits and a scratch directory only)"
        if os.geteuid() != 0:
            return ("code runs without network or filesystem isolation: namespaces and a user id of its own "
                    "need root (limits and a scratch directory only)")
        if _interpreter() is None:
            return (f"code runs without isolation: no Python here that a user of its own may run ({sys.executable} "
                    "lies under a directory only root may enter); limits and a scratch directory only")
        return None

    async def run(self, code: str, stdin: str = "") -> RunResult:
        isolated = self.isolation() is None
        if isolated:
            async with _free_slot() as uid:
                return await self._run(code, stdin, uid, None)
        with tempfile.TemporaryDirectory(prefix="sandbox-") as scratch:
            return await self._run(code, stdin, None, scratch)

    async def _run(self, code: str, stdin: str, uid: int | None, scratch: str | None) -> RunResult:
        lim = self.limits
        env = {"PATH": "/usr/bin:/bin", "HOME": scratch or "/tmp", "TMPDIR": scratch or "/tmp", "LANG": "C.UTF-8",
               "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}
        python = (_interpreter() if uid is not None else None) or sys.executable
        proc = await asyncio.create_subprocess_exec(
            python, "-I", "-c", code, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=env, cwd=scratch or "/", start_new_session=True,
            preexec_fn=lambda: _confine(lim, uid))

        def kill() -> None:
            _kill(proc.pid, uid)

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
            _kill(proc.pid, uid)  # whatever it left behind, found by its user id (or its group)
            # The pipes read to their end (every writer is dead now): asyncio's wait() returns
            # only once they are closed.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(5.0):
                    await drains
            with contextlib.suppress(ProcessLookupError):
                await proc.wait()
        flooded = out.flooded or err.flooded
        code_ = proc.returncode
        outcome = _outcome(code_, err.text(), timed_out, flooded)
        return RunResult(out.text(), err.text(), code_, outcome, uid is not None, out.truncated or err.truncated)


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


@functools.cache
def _interpreter() -> str | None:
    """The first Python a sandbox user can start: this one, unless it lies under a directory
    only root may enter (pyenv in /root), then the system's. Asked once, by running it confined."""
    for candidate in dict.fromkeys([sys.executable, shutil.which("python3") or "", "/usr/bin/python3"]):
        if not candidate or not os.path.exists(candidate):
            continue
        with _slot() as uid:
            try:
                probe = subprocess.run([candidate, "-I", "-c", "pass"], env={"PATH": "/usr/bin:/bin"}, timeout=30,
                                       capture_output=True, preexec_fn=lambda: _confine(Limits(), uid))
            except (OSError, subprocess.SubprocessError):
                continue
            finally:
                _kill_user(uid)
            if probe.returncode == 0:
                return candidate
    return None


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
    """_free_slot for a caller outside the event loop (the interpreter probe), without waiting."""
    taken = _take_slot()
    if taken is None:
        raise RuntimeError(f"all {len(SLOTS)} sandbox user ids are in use")
    try:
        yield taken[0]
    finally:
        os.close(taken[1])


def _take_slot() -> tuple[int, int] | None:
    """(uid, its lock's fd) for a user id no other run holds (flock on a file per id, so other
    processes' runs count too), or None. Whatever a dead holder left running is killed first."""
    LOCKS.mkdir(mode=0o700, exist_ok=True)
    for uid in SLOTS:
        fd = os.open(LOCKS / str(uid), os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        _kill_user(uid)
        return uid, fd
    return None


def _confine(lim: Limits, uid: int | None) -> None:
    """In the child, before exec: namespaces and mounts (isolated runs), limits, then the user id."""
    if uid is not None:
        if _libc.unshare(CLONE_NEWNS | CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "unshare")
        _mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None)  # nothing below leaks to the host
        _mount(b"tmpfs", b"/tmp", b"tmpfs", MS_NOSUID | MS_NODEV, f"size={lim.scratch_mb}m,mode=1777".encode())
        _mount(b"tmpfs", b"/dev/shm", b"tmpfs", MS_NOSUID | MS_NODEV, b"size=1m,mode=1777")
        _mount(b"/", b"/", None, MS_BIND | MS_REMOUNT | MS_RDONLY, None)
        os.chdir("/tmp")
    memory = lim.memory_mb * 2**20
    for which, value in ((resource.RLIMIT_CPU, lim.cpu_s), (resource.RLIMIT_AS, memory),
                         (resource.RLIMIT_FSIZE, lim.scratch_mb * 2**20), (resource.RLIMIT_NOFILE, lim.open_files),
                         (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(which, (value, value + 1 if which == resource.RLIMIT_CPU else value))
    if uid is not None:
        resource.setrlimit(resource.RLIMIT_NPROC, (lim.processes, lim.processes))
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)


def _kill(pid: int, uid: int | None) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    if uid is not None:
        _kill_user(uid)


def _kill_user(uid: int) -> None:
    """SIGKILL every process of `uid`: kill(-1) from a child that became that user reaches all of
    them and nothing else. Twice: a fork in flight during the first may have made one more."""
    for _ in range(2):
        pid = os.fork()
        if pid == 0:
            try:
                os.setgid(uid)
                os.setuid(uid)
                os.kill(-1, signal.SIGKILL)
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
