"""An async reward function: the group's completions scored concurrently in the event loop, each
bounded by orchestrator.timeouts.reward_s (orchestrator/rewards/reward.py)."""

from __future__ import annotations

import asyncio

from orchestrator.rewards.reward import FunctionReward, Score, as_score


class AsyncReward(FunctionReward):
    async def score(self, prompt: str, completions: list[str], row: dict) -> list[Score | None]:
        return list(await asyncio.gather(*(self.one(prompt, c, row) for c in completions)))

    async def one(self, prompt: str, completion: str, row: dict) -> Score | None:
        try:
            async with asyncio.timeout(self.timeout_s):  # not wait_for: it can lose a cancel (orchestrator.bounded_wait)
                return as_score(await self.fn(prompt, completion, row))
        except TimeoutError:
            self.timed_out()
        except Exception as e:
            self.failed(f"failed: {type(e).__name__}: {e}")
        return None
