"""A reward endpoint: POST {"prompt", "completion", "row"} -> {"reward": score}, one request per
completion, all of a group's at once (orchestrator/rewards/reward.py)."""

from __future__ import annotations

import asyncio

import aiohttp

from orchestrator.rewards.reward import Reward, Score, as_score


class HttpReward(Reward):
    def __init__(self, spec: str, timeout_s: float, session: aiohttp.ClientSession):
        super().__init__(spec, timeout_s)
        self.session = session

    async def score(self, prompt: str, completions: list[str], row: dict) -> list[Score | None]:
        return list(await asyncio.gather(*(self.one(prompt, c, row) for c in completions)))

    async def one(self, prompt: str, completion: str, row: dict) -> Score | None:
        # The total timeout also counts waiting for a free connection of the session's pool,
        # which is sized for every generation request in flight plus some, so that wait is short.
        try:
            async with self.session.post(self.spec, json={"prompt": prompt, "completion": completion, "row": row},
                                         timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as r:
                r.raise_for_status()
                return as_score((await r.json())["reward"])
        except TimeoutError:
            self.timed_out()
        except Exception as e:
            self.failed(f"failed: {type(e).__name__}: {e}")
        return None
