"""orchestrator/bounded_wait.py wait_visibly: every orchestrator wait ends on its predicate, on its
timeout with a line naming what it waited for, or on what `check` raises (a dead background loop,
a run that can only spin); none waits on silently."""

from __future__ import annotations

import asyncio

import pytest

from orchestrator.bounded_wait import wait_visibly


def test_a_notify_ends_the_wait_once_the_predicate_holds():
    async def scenario():
        changed, state = asyncio.Condition(), {"ready": False}

        async def make_ready():
            await asyncio.sleep(0)
            state["ready"] = True
            async with changed:
                changed.notify_all()

        task = asyncio.create_task(make_ready())
        waited = await wait_visibly(changed, lambda: state["ready"], "readiness", 30.0, lambda: None)
        await task
        return waited

    assert asyncio.run(scenario()) >= 0.0


def test_a_wait_already_satisfied_returns_at_once_without_checking():
    def check():
        raise AssertionError("checked though nothing was waited for")

    assert asyncio.run(wait_visibly(asyncio.Condition(), lambda: True, "nothing", 1.0, check)) == 0.0


def test_the_timeout_names_what_was_awaited():
    with pytest.raises(TimeoutError, match="waiting for room for a new group"):
        asyncio.run(wait_visibly(asyncio.Condition(), lambda: False, "room for a new group", 0.0, lambda: None))


def test_what_check_raises_ends_the_wait():
    looks = []

    def check():
        looks.append(1)
        raise RuntimeError("background task follow_weights stopped")

    with pytest.raises(RuntimeError, match="follow_weights stopped"):
        asyncio.run(wait_visibly(asyncio.Condition(), lambda: False, "a batch", 60.0, check))
    assert looks == [1]  # raised at the first look, not after the timeout
