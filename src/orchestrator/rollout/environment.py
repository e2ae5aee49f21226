"""What a rollout is: single-turn (a prompt, n completions, a reward each) or a multi-turn
episode in which the model is called several times (a game, tool calls).

A multi-turn environment is a class named in the config (`class = "module:Class"` under
`[orchestrator.environment]`), built with that table's `args` (none by default):

    class MyEnv:
        def dataset(self, seed) -> Iterator[dict]:   # rows, JSON-able, same for the same seed
        def episode(self, row) -> Episode:            # one fresh episode per rollout

    class MyEpisode:
        def start(self) -> str:                       # the first prompt (or a picture: Turn.observation)
        def step(self, completion: str) -> Turn:      # sync or async

The orchestrator appends each completion's tokens (trained on) and each observation's tokens (not
trained on: loss mask 0) to one token sequence, so the trainer sees exactly what the model saw.
The episode's reward is the sum of its turns' rewards; group-relative advantages then apply as for
single-turn rollouts. Nothing else in the pipeline (staleness, batching, weight sync) differs.

A tool environment talks through the model's chat template and gives it functions to call:

    class MyToolEnv:
        tools = [calculate, search]                    # functions, sync or async (orchestrator/rollout/tool_functions.py)
        system_prompt = "..."                          # optional
        def dataset(self, seed) -> Iterator[dict]:     # rows with "prompt" or "messages"
        def reward(self, messages, row) -> float:      # sync or async; the whole conversation
        def messages(self, row) -> list[dict]:         # optional: the opening messages (else the row's)

A tool may return a picture (a PIL image, or a list of content parts: strings, PIL images, OpenAI
`image_url` parts with data: URLs), and opening messages may hold image parts: a vision-language
model sees them through its processor (orchestrator/rollout/turn_images.py, docs/vlm.md).

Each tool's JSON schema comes from its signature and docstring; the model's calls are read by
orchestrator.tools.parser, run under orchestrator.timeouts.tool_s, and answered with tool
messages until it answers without a call (orchestrator/rollout/tool_episode.py). `messages` is the
conversation in OpenAI form: the assistant's answer is the last message's content.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol


@dataclass
class Turn:
    observation: str | list | None = None
    """The environment's reply, shown to the model before its next call: text, or a picture (a PIL
    image, or content parts holding pictures: orchestrator/rollout/turn_images.py)."""
    reward: float = 0.0
    done: bool = False


class Episode(Protocol):
    def start(self) -> str: ...

    def step(self, completion: str) -> Turn: ...


class Environment(Protocol):
    def dataset(self, seed: int) -> Iterator[dict]: ...

    def episode(self, row: dict) -> Episode: ...


class ToolEnvironment(Protocol):
    tools: list

    def dataset(self, seed: int) -> Iterator[dict]: ...

    def reward(self, messages: list[dict], row: dict) -> float: ...

