"""The memory all sandboxed runs of this process may hold at once (orchestrator.sandbox.memory_mb):
a run waits until its worst case fits beside those running. The orchestrator scores a whole
group's completions at once, several groups at a time, and each coding completion is a run: four
runs of 16 x 512 MB could take a 24 GiB machine from vLLM and the trainer (issue 60).

A run's worst case is what its bound guarantees (sandbox_cgroup.py): its total under a cgroup;
with rlimits only, its address space times its processes. One run larger than the whole budget
still runs, alone, rather than never."""

from __future__ import annotations

import asyncio
import contextlib

DEFAULT_MB = 4096  # orchestrator.sandbox.memory_mb's default, for runs outside an orchestrator
WAIT_S = 600.0  # the longest a run waits for room (a reward call's own timeout is shorter)


class MemoryBudget:
    def __init__(self, limit_mb: int = DEFAULT_MB):
        self.limit_mb, self.held_mb, self.running, self.most_running = limit_mb, 0, 0, 0
        self._freed: asyncio.Condition | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def configure(self, limit_mb: int) -> None:
        self.limit_mb = limit_mb

    def _condition(self) -> asyncio.Condition:
        """One condition per event loop (tests run several loops, one after another)."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._loop, self._freed, self.held_mb, self.running = loop, asyncio.Condition(), 0, 0
        return self._freed

    @contextlib.asynccontextmanager
    async def hold(self, mb: int):
        freed = self._condition()
        async with freed:
            try:
                async with asyncio.timeout(WAIT_S):
                    await freed.wait_for(lambda: self.running == 0 or self.held_mb + mb <= self.limit_mb)
            except TimeoutError:
                raise RuntimeError(f"no room for a {mb} MB sandboxed run in orchestrator.sandbox.memory_mb = "
                                   f"{self.limit_mb} for {WAIT_S:.0f} s") from None
            self.held_mb += mb
            self.running += 1
            self.most_running = max(self.most_running, self.running)
        try:
            yield
        finally:
            async with freed:
                self.held_mb -= mb
                self.running -= 1
                freed.notify_all()


BUDGET = MemoryBudget()
