"""Waiting on an asyncio.Condition with a bound, without losing a cancel, and visibly: every
timed wait of the orchestrator on its `changed` condition goes through here."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

log = logging.getLogger("orchestrator")

HEARTBEAT_S = 15.0  # how often a wait says what it still waits for


async def notified(changed: asyncio.Condition, timeout_s: float, predicate=None) -> None:
    """changed.wait() (changed.wait_for(predicate) with one), the lock held, for at most
    timeout_s. Through asyncio.timeout, never asyncio.wait_for: Python 3.11's wait_for returns
    the inner result when the inner wait ended in the same loop turn as a cancel of the caller,
    and the cancel is lost. A SIGTERM is such a cancel (orchestrator/main.py): once, a run told
    to stop went on waiting for its final version for minutes."""
    try:
        async with asyncio.timeout(timeout_s):
            await (changed.wait() if predicate is None else changed.wait_for(predicate))
    except TimeoutError:
        pass


async def wait_visibly(changed: asyncio.Condition, predicate: Callable[[], bool], what: str, timeout_s: float,
                       check: Callable[[], None]) -> float:
    """Wait for `predicate()`, woken by `changed` (and once a second), saying every HEARTBEAT_S
    what it still waits for; `check()` raises what makes waiting on pointless, after each wake-up.
    Returns the seconds waited; TimeoutError past timeout_s."""
    if predicate():
        return 0.0
    start = last_beat = time.monotonic()
    async with changed:
        while not predicate():
            check()
            now = time.monotonic()
            if now - start > timeout_s:
                raise TimeoutError(f"gave up after {timeout_s:.0f} s waiting for {what}")
            if now - last_beat > HEARTBEAT_S:
                log.info("still waiting for %s (%.0f s)", what, now - start)
                last_beat = now
            await notified(changed, 1.0)
    return time.monotonic() - start
