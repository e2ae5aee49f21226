"""Watching one sandboxed run: stdin fed, both streams read as they come (kept up to
`output_bytes`; a run writing OUTPUT_FLOOD times that is killed), the wall clock enforced,
whatever is left killed, and the outcome named (sandbox.py's docstring lists them).

The run is a subprocess.Popen whose pipes are read and written here, on the event loop's own
readiness callbacks, not an asyncio subprocess: asyncio (3.11) wakes whoever waits on a process
only once its pipes have been connected and closed, and a start cancelled before the loop
connected them (asyncio.run shutting down while runs start) waits forever, its cleanup included.
Here the process exists the moment Popen returns, and from then on a cancellation at any await
kills its group, ends its pipes and reaps it, within bounds (PIPES_END_S, REAP_S)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess

from orchestrator.sandbox.sandbox_limits import Limits

OUTPUT_FLOOD = 64
EXIT_GRACE_S = 0.5  # output still arriving after the program exits, from what it started
PIPES_END_S = 5.0  # after the kill: the pipes' last writers (a namespace dying, a setsid'd child) gone
REAP_S = 5.0  # after the kill: the run's first process reaped (else subprocess reaps it later)
POLL_S = 0.05


async def supervise(proc: subprocess.Popen, lim: Limits, stdin: str):
    """Feeds stdin, reads both streams, enforces the wall clock and the output flood, and kills
    whatever is left, cancelled or not: (exit code, stdout, stderr, timed out, flooded, truncated).
    `proc`: started with stdin, stdout and stderr pipes (bufsize=0) and a session of its own."""

    def kill() -> None:
        kill_run(proc.pid)

    out, err = _Capped(lim.output_bytes, kill), _Capped(lim.output_bytes, kill)
    drains = asyncio.ensure_future(asyncio.gather(out.drain(proc.stdout), err.drain(proc.stderr)))
    feed = asyncio.ensure_future(_feed(proc.stdin, stdin.encode()))
    exited = asyncio.ensure_future(_exited(proc))
    timed_out = False
    try:
        async with asyncio.timeout(lim.wall_s):
            await asyncio.wait({drains, exited}, return_when=asyncio.FIRST_COMPLETED)
            if not drains.done():  # it exited, and what it started holds the pipes open
                await asyncio.wait({drains}, timeout=EXIT_GRACE_S)
                kill()
            await drains
    except TimeoutError:
        timed_out = True
    finally:
        kill()  # whatever it left behind
        await _settle(proc, drains, feed, exited)
    return (proc.returncode, out.text(), err.text(), timed_out, out.flooded or err.flooded,
            out.truncated or err.truncated)


async def _settle(proc: subprocess.Popen, drains: asyncio.Future, feed: asyncio.Future,
                  exited: asyncio.Future) -> None:
    """After the kill: the pipes read to their end (every writer is dead, or PIPES_END_S has
    passed), every helper finished (each closes its own pipe), the first process reaped."""
    feed.cancel()
    exited.cancel()
    await asyncio.wait({drains}, timeout=PIPES_END_S)
    drains.cancel()
    await asyncio.wait({drains, feed, exited})
    for helper in (drains, feed, exited):
        if not helper.cancelled():
            helper.exception()  # retrieved: a cancellation from outside reaches them as one
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        pipe.close()  # a helper cancelled before it ever ran did not
    for _ in range(int(REAP_S / POLL_S)):
        if proc.poll() is not None:
            return
        await asyncio.sleep(POLL_S)


async def namespace_gone(info: int) -> None:
    """Kills the run's PID namespace and waits (5 s at most) until it is empty: bwrap may exit
    (with the program's status) before its first process inside has, the kernel lets that process
    exit only after every other process of the namespace, and one whose bwrap was killed while
    still setting up (a run cancelled as it starts) may not yet have asked to die with it. Its pid
    is what bwrap wrote on --info-fd (nothing if bwrap died before making it); a pidfd of it turns
    readable once it has exited."""
    try:
        pid = int(json.loads(os.read(info, 4096))["child-pid"])
        pidfd = os.pidfd_open(pid)
    except (OSError, ValueError, KeyError, TypeError):
        return  # never made, or gone already
    try:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)  # the pidfd: never another process
        with contextlib.suppress(TimeoutError), _ready(pidfd) as gone:
            async with asyncio.timeout(5.0):
                await gone.wait()
    finally:
        os.close(pidfd)


async def _exited(proc: subprocess.Popen) -> None:
    """The program itself has exited (and is reaped), whoever still holds its pipes."""
    while proc.poll() is None:
        await asyncio.sleep(POLL_S)


async def _feed(pipe, data: bytes) -> None:
    """Writes `data` to the run's stdin as it takes it, then closes it; a program that exits, or
    closes its stdin, without reading it all ends the feed."""
    view = memoryview(data)
    try:
        with _ready(pipe.fileno(), write=True) as ready:
            while view:
                await ready.wait()
                ready.clear()
                with contextlib.suppress(BlockingIOError):
                    view = view[os.write(pipe.fileno(), view):]
    except ConnectionError:
        pass
    finally:
        pipe.close()


class _Capped:
    """A stream read to its end, its first `cap` bytes kept. Past OUTPUT_FLOOD times that it
    calls `flood` once (the run kills the program) and reads on to the end, discarding."""

    def __init__(self, cap: int, flood):
        self.cap, self.flood, self.data, self.seen, self.flooded = cap, flood, bytearray(), 0, False

    async def drain(self, pipe) -> None:
        """Reads `pipe` (the run's stdout or stderr) to its end, then closes it."""
        try:
            with _ready(pipe.fileno()) as ready:
                while True:
                    await ready.wait()
                    ready.clear()
                    try:
                        chunk = os.read(pipe.fileno(), 65536)
                    except BlockingIOError:
                        continue
                    if not chunk:
                        return
                    self._take(chunk)
        finally:
            pipe.close()

    def _take(self, chunk: bytes) -> None:
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


@contextlib.contextmanager
def _ready(fd: int, write: bool = False):
    """An event the loop sets whenever `fd` (made non-blocking) can be read (or written), for as
    long as the block lasts: the callback is gone before the caller closes the fd."""
    loop = asyncio.get_running_loop()
    ready = asyncio.Event()
    os.set_blocking(fd, False)
    (loop.add_writer if write else loop.add_reader)(fd, ready.set)
    try:
        yield ready
    finally:
        (loop.remove_writer if write else loop.remove_reader)(fd)


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
