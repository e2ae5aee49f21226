"""Waiting on an asyncio.Condition with a bound, without losing a cancel: every timed wait of
the orchestrator on its `changed` condition goes through here."""

from __future__ import annotations

import asyncio


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
