"""What a run's rollouts are made of: one kind per run, chosen once at start-up from the config
(orchestrator/rollout/registry.py), so the rest of the orchestrator never asks which it is.

A kind turns a drawn prompt into the group's trajectories: token ids, the loss mask (1 where the
model sampled), the sampler's logprobs and per-token versions, and a reward each. The shipped
kinds: datasets (single-turn: one request of n completions, scored by the dataset's reward;
orchestrator/rollout/single_turn.py), a text environment (n multi-turn episodes in raw text;
orchestrator/rollout/text_environment.py) and a tool environment (n tool-calling episodes through the chat
template; orchestrator/rollout/tool_environment.py). Group assembly (advantages, the teacher, overlong
masking) is the same for all: orchestrator/rollout/groups.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from rl.config.datasets import Sampling
from rl.inference_api import GeneratedSample, GenerateRequest, GenerateResponse
from rl.routing_rows import RoutingRows

if TYPE_CHECKING:
    from orchestrator.prompts import Prompt

Generate = Callable[[GenerateRequest], Awaitable[GenerateResponse]]
"""Handed in by the scheduler (orchestrator/orchestrator.py): it pins the group to a server and
records each request id so that a cancelled group can be aborted on that server."""



class Aborted(Exception):
    """The server aborted a request of this group (it was cancelled, or the server is going down)."""


async def gather_or_cancel(coros) -> list:
    """asyncio.gather, except that when one fails the others are cancelled rather than left to
    run on (sending requests for a group that already failed)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


@dataclass
class Trajectory:
    tokens: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    reward: float
    components: dict[str, float] = dataclasses.field(default_factory=dict)
    truncated: bool = False
    episode: dict[str, float] = dataclasses.field(default_factory=dict)
    parts: list[Trajectory] = dataclasses.field(default_factory=list)
    """More samples of the same episode, with its reward (an agent's requests that do not extend
    one conversation: orchestrator/rollout/agent_environment.py)."""
    # The sampler's kept set per token, as rl/batch.py carries it (0 / nothing where none).
    kept_counts: list[int] = dataclasses.field(default_factory=list)
    kept_ids: list[int] = dataclasses.field(default_factory=list)
    # The engine's routed experts (answers asked with routed_experts: inference.record_routing),
    # merged over the turns: positions no answer covers (the last sampled token, environment
    # tokens after the last turn) stay unrecorded, and replay uses the trainer's own routing there.
    routing: RoutingRows | None = None
    # The prompt's images (PNG bytes, in the order of its placeholders): rl/batch.py Sample.images.
    images: list[bytes] = dataclasses.field(default_factory=list)

    def add(self, ids: list[int], model: GeneratedSample | None = None) -> None:
        self.tokens += ids
        self.loss_mask += [1 if model else 0] * len(ids)
        self.logprobs += model.logprobs if model else [0.0] * len(ids)
        self.versions += model.versions if model else [-1] * len(ids)
        kept = model.kept if model and model.kept is not None else [[]] * len(ids)
        self.kept_counts += [len(k) for k in kept]
        self.kept_ids += [t for k in kept for t in k]
        if model is not None and model.routed_experts is not None:
            self.routing = self.routing or RoutingRows.like(model.routed_experts)
            self.routing.add(model.routed_experts)

    def routing_fields(self) -> dict:
        """rl/batch.py Sample's routed_experts and routed; none without a record."""
        if self.routing is None:
            return {}
        experts, routed = self.routing.padded(len(self.tokens))
        return {"routed_experts": experts, "routed": routed}


class Toolkit(Protocol):
    """What a kind uses to talk to the model (orchestrator/rollout/groups.py Rollouts): the tokenizer's
    way in and out, and the request every kind sends (cut to the room seq_len leaves)."""

    fast: object
    """The Rust tokenizer (tokenizers.Tokenizer) behind the model's, or None."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def decode_all(self, ids: list[list[int]]) -> list[str]: ...

    def request(self, request_id: str, tokens: list[int], n: int, sampling: Sampling,
                where: str = "a prompt", stop_token_ids: list[int] | None = None,
                images=None) -> GenerateRequest: ...


class RolloutKind(ABC):
    """One kind of rollout, built once per run as KIND(cfg, toolkit, renderer, sources, env, rewards)
    (orchestrator/rollout/registry.py): `sources` the datasets by name, `rewards` their rewards by
    the same names (the datasets kind's), `env` the built environment (the environment kinds').
    The rows it plays come from the prompts station (orchestrator/prompts/rows.py), not from it.
    `stop_token_ids`: where its completions end beyond the sampling settings' own stops."""

    stop_token_ids: list[int] = []
    sources: dict = {}
    """The datasets drawn from, by name (the datasets kind's; reporting breaks a step down by them)."""

    @abstractmethod
    def sampling(self, prompt: Prompt) -> Sampling:
        """The settings `prompt`'s rollouts are sampled with (the trainer rebuilds the kept set from them)."""

    @abstractmethod
    async def trajectories(self, prompt: Prompt, gid: str, generate: Generate) -> list[Trajectory | None]:
        """The group's rollouts; None for one that failed on its own (its reward or episode raised).
        Raises Aborted when the server aborted a request, RowError when the row cannot be used."""

    @abstractmethod
    def last_error(self, prompt: Prompt) -> str:
        """The latest failure of what scores `prompt`'s rollouts, for a group left with none."""

    @abstractmethod
    def culprit(self, prompt: Prompt) -> str:
        """Whose rows `prompt` is, as the line that stops a spinning run names it."""

    @abstractmethod
    def failure_fix(self, prompt: Prompt) -> str:
        """What to change when `prompt`'s groups keep failing."""
