"""The shapes task (tasks/shapes.py) as a two-turn agent written only against the official OpenAI
client, each turn's observation a picture (docs/vlm.md, "Agents with pictures"): the agent shows
the model a board and asks how many shapes it holds, then shows a second board and asks again.
The reward is the second answer against the second board's count. The pictures ride in the
conversation as `image_url` parts with data: URLs, as an OpenAI client sends them; the
orchestrator's agent endpoint renders them with the model's processor and the trainer sees them.

    model = "models/tiny-vlm"
    [orchestrator.environment]
    class = "tasks.shapes_agent:ShapesAgent"
"""

from __future__ import annotations

import base64
import random
from collections.abc import Iterator

from tasks.shapes import QUESTION, draw, reward

AGAIN = "And in this picture? Answer with a number."


def picture_part(png: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}}


class ShapesAgent:
    tools = None  # no tools: the observations are the pictures

    def dataset(self, seed: int) -> Iterator[dict]:
        """Endless seeded rows {"boards": two PNGs (base64), "answers": their counts}."""
        i = 0
        while True:
            rng = random.Random(f"agent/{seed}/{i}")
            (a, na), (b, nb) = draw(rng), draw(rng)
            yield {"boards": [base64.b64encode(a).decode(), base64.b64encode(b).decode()],
                   "answers": [str(na), str(nb)]}
            i += 1

    async def agent(self, row: dict, access) -> float:
        messages = await self.conversation(row, access)
        return reward("", messages[-1]["content"], {"answer": row["answers"][1]})

    async def conversation(self, row: dict, access) -> list[dict]:
        """The two turns, as sent and answered (the last message: the model's second answer)."""
        messages: list[dict] = []
        async with access.client() as client:  # its connections closed with the episode
            for board, asked in zip(row["boards"], (QUESTION, AGAIN)):
                messages.append({"role": "user", "content": [picture_part(base64.b64decode(board)),
                                                             {"type": "text", "text": asked}]})
                answer = await client.chat.completions.create(model=access.model, messages=messages)
                messages.append({"role": "assistant", "content": answer.choices[0].message.content or ""})
        return messages
