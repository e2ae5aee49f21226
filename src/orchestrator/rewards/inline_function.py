"""A sync reward function called in the event loop (orchestrator.reward_inline): no thread hop,
for rewards known to be fast (orchestrator/rewards/reward.py)."""

from __future__ import annotations

from orchestrator.rewards.reward import FunctionReward, Score


class InlineReward(FunctionReward):
    async def score(self, prompt: str, completions: list[str], row: dict) -> list[Score | None]:
        return [self.call(prompt, c, row) for c in completions]
