"""The external-agent environment kind: `orchestrator.environment.class` names a class with
dataset(seed) and an agent of the user's own, written against the official OpenAI client:

    class MyAgent:
        def dataset(self, seed): ...                       # rows, as any environment's
        async def agent(self, row, access) -> float | list[dict]:
            client = access.client()                       # openai.AsyncOpenAI on the episode's endpoint
            ...                                            # any loop: chat.completions.create(..., tools=...)
            return reward                                  # or the final messages, for reward(messages, row)
        def reward(self, messages, row) -> float: ...      # needed only when agent returns messages

Each episode gets its own API key on the orchestrator's endpoint (orchestrator/rollout/agent_endpoint.py),
whose requests sample on the group's server like any rollout (stale groups cancelled and aborted,
max_async_level, per-token versions). The trajectory is rebuilt from what the server sampled, in
order: where each request's prompt ids begin with the previous request's prompt and completion
(the conversation only grew), the requests are one sample, the ids between two completions
context (mask 0); where the agent edited or dropped history, a new sample starts. An episode may
so become several samples, each with the episode's reward (and its advantage).

An agent may put pictures in its user or tool turns (`image_url` parts with data: URLs: an
observation that is a picture): each request is rendered with the model's processor's expansion
and sent with its pictures (orchestrator/rollout/agent_images.py), and each sample carries the
pictures of its last request in placeholder order (`Trajectory.images`, as a dataset row's). A
request grows the previous one only if its pictures begin with the previous one's (the PNGs the
endpoint made, byte for byte): the same placeholder ids with another picture are another
conversation. A picture the
endpoint refuses fails the episode with one line naming the episode and the part.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass

from orchestrator.callables import load_callable
from orchestrator.rendering import ChatTemplate, ImageError, Opening, image_support
from orchestrator.rollout.agent_endpoint import AgentEndpoint
from orchestrator.rollout.agent_images import AgentImages
from orchestrator.rollout.environment_base import EnvironmentKind
from orchestrator.rollout.kind import Aborted, Generate, Toolkit, Trajectory
from orchestrator.rollout.tool_environment import needed_template
from orchestrator.rollout.tool_episode import opening_measure
from orchestrator.rollout.tool_parsers import PARSERS, tool_parser
from rl.config import ConfigError, RunConfig
from rl.inference_api import GeneratedSample

# The official client's transport logs every request at INFO: thousands a step.
logging.getLogger("httpx").setLevel(logging.WARNING)


@dataclass(frozen=True)
class AgentAccess:
    """What an agent needs to reach the model for one episode."""
    base_url: str
    api_key: str
    model: str

    def client(self, **kwargs):
        """The official async client on this episode's endpoint (no retries: a refused request
        is an answer, not a glitch)."""
        import openai

        return openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, **{"max_retries": 0, **kwargs})


class AgentEpisodes(EnvironmentKind):
    fit_keys = "orchestrator.sampling.max_tokens or shorten the questions (the agent's first request is measured as one user turn)"

    def __init__(self, cfg: RunConfig, toolkit: Toolkit, renderer, sources, env, rewards=None):
        super().__init__(cfg, toolkit, renderer, sources, env, rewards)
        self.stop_token_ids = renderer.stop_token_ids
        template = needed_template(cfg, renderer.template)
        self.endpoint = AgentEndpoint(template, toolkit.encode, toolkit.decode, tool_parser(self.settings.tools.parser),
                                      toolkit.request, self.env_sampling, str(cfg.model),
                                      AgentImages(template, renderer.image_support, toolkit.fast))
        # An agent that neither asks nor answers: its turns' own bounds, and its tools' time.
        s = self.settings
        self.timeout_s = s.environment.max_turns * (s.timeouts.request_s + s.timeouts.tool_s)

    async def episode(self, row: dict, eid: str, generate: Generate) -> Trajectory | None:
        await self.endpoint.start()
        key, record = self.endpoint.open(eid, generate)
        try:
            async with asyncio.timeout(self.timeout_s):
                result = await self.env.agent(row, AgentAccess(self.endpoint.base_url, key, str(self.cfg.model)))
            reward = await self.reward(result, row)
        except Exception as e:
            if record.aborted:
                raise Aborted(eid) from None
            return self.failed(eid, ImageError(record.failure) if record.failure else e)
        finally:
            self.endpoint.close(key)
        if record.aborted:
            raise Aborted(eid)
        if record.failure:  # the agent went on after a refused picture: still not trained on
            return self.failed(eid, ImageError(record.failure))
        if not record.turns:
            return self.failed(eid, RuntimeError("the agent never asked the model"))
        t = rebuilt(record.turns, reward)
        t.truncated = t.truncated or record.out_of_room
        return t

    async def reward(self, result, row: dict) -> float:
        if isinstance(result, list):  # the final messages: the environment scores them
            result = self.env.reward(result, row)
            if inspect.isawaitable(result):
                result = await result
        if isinstance(result, bool) or not isinstance(result, (int, float)):
            raise TypeError(f"{type(self.env).__name__}: the agent's result gave {type(result).__name__}, not a "
                            "number (return a reward, or the messages for reward(messages, row))")
        return float(result)

    @classmethod
    def start_up(cls, cfg: RunConfig, env) -> Callable[[object], Opening]:
        key = f"orchestrator.environment.class = {cfg.orchestrator.environment.class_!r}"
        if not inspect.iscoroutinefunction(getattr(env, "agent", None)):
            raise ConfigError(f"{key}: an agent environment's agent(row, access) must be an async def")
        if cfg.orchestrator.tools.parser not in PARSERS:
            load_callable(cfg.orchestrator.tools.parser, "orchestrator.tools.parser")
        template = needed_template(cfg, ChatTemplate.configured(cfg.orchestrator, cfg.model))
        return opening_measure(env, template, image_support(cfg.model))


def rebuilt(turns: list[tuple[list[int], GeneratedSample, list[bytes]]], reward: float) -> Trajectory:
    """The episode's samples from its requests in order (module docstring): the first, with the
    rest as its `parts`. Each request: its prompt ids, what it sampled, its pictures."""
    pieces: list[Trajectory] = []
    for ids, sample, images in turns:
        last = pieces[-1] if pieces else None
        if last is not None and ids[:len(last.tokens)] == last.tokens and images[:len(last.images)] == last.images:
            last.add(ids[len(last.tokens):])
        else:
            last = Trajectory([], [], [], [], reward)
            last.add(ids)
            pieces.append(last)
        last.images = list(images)
        last.add(sample.token_ids, sample)
        last.truncated = last.truncated or sample.finish_reason == "length"
    first = pieces[0]
    first.parts = pieces[1:]
    first.episode = {"turns": len(turns), "samples": len(pieces), "tokens": sum(len(p.tokens) for p in pieces)}
    return first
