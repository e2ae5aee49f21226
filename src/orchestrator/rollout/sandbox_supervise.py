"""Watching one sandboxed run: stdin fed, both streams read as they come (kept up to
`output_bytes`; a run writing OUTPUT_FLOOD times that is killed), the wall clock enforced,
whatever is left killed, and the outcome named (sandbox.py's docstring lists them)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal

from orchestrator.rollout.sandbox_limits import Limits

OUTPUT_FLOOD = 64
EXIT_GRACE_S = 0.5  # output still arriving after the program exits, from what it started


async def supervise(proc: asyncio.subprocess.Process, lim: Limits, stdin: str):
    """Feeds stdin, reads both streams, enforces the wall clock and the output flood, and kills
    whatever is left: (exit code, stdout, stderr, timed out, flooded, truncated)."""

    def kill() -> None:
        kill_run(proc.pid)

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


async def namespace_gone(info: int) -> None:
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


def outcome_of(code: int | None, stderr: str, timed_out: bool, flooded: bool, oom: bool = False) -> str:
    """`oom`: the kernel's OOM killer killed a process of the run (its cgroup's memory bound)."""
    if flooded:
        return "output"
    if timed_out:
        return "timeout"
    if code == 0:
        return "ok"
    if oom and code != 0:
        return "memory"
    if code in (-signal.SIGXCPU, -signal.SIGKILL) and "MemoryError" not in stderr:
        return "cpu" if code == -signal.SIGXCPU else "killed"
    if "MemoryError" in stderr:
        return "memory"
    return "error" if code is not None and code > 0 else "killed"




def kill_run(pid: int) -> None:
    """The run's process group: unisolated, the program and what did not leave the group;
    isolated, bwrap, whose first process inside dies with it (--die-with-parent), and with that
    process every other process of the PID namespace, those that called setsid included."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
