"""What a rollout is: single-turn (a prompt, n completions, a reward each) or a multi-turn
episode in which the model is called several times (a game, tool calls).

A multi-turn environment is a class named in the config (`orchestrator.environment =
"module:Class"`), built with no arguments:

    class MyEnv:
        def dataset(self, seed) -> Iterator[dict]:   # rows, JSON-able, same for the same seed
        def episode(self, row) -> Episode:            # one fresh episode per rollout

    class MyEpisode:
        def start(self) -> str:                       # the first prompt
        def step(self, completion: str) -> Turn:      # sync or async

The orchestrator appends each completion's tokens (trained on) and each observation's tokens (not
trained on: loss mask 0) to one token sequence, so the trainer sees exactly what the model saw.
The episode's reward is the sum of its turns' rewards; group-relative advantages then apply as for
single-turn rollouts. Nothing else in the pipeline (staleness, batching, weight sync) differs.

A tool environment talks through the model's chat template and gives it functions to call:

    class MyToolEnv:
        tools = [calculate, search]                    # functions, sync or async (orchestrator/tools.py)
        system_prompt = "..."                          # optional
        def dataset(self, seed) -> Iterator[dict]:     # rows with "prompt" or "messages"
        def reward(self, messages, row) -> float:      # sync or async; the whole conversation
        def messages(self, row) -> list[dict]:         # optional: the opening messages (else the row's)

Each tool's JSON schema comes from its signature and docstring; the model's calls are read by
orchestrator.tool_parser, run under orchestrator.tool_timeout_s, and answered with tool
messages until it answers without a call (orchestrator/tool_episode.py). `messages` is the
conversation in OpenAI form: the assistant's answer is the last message's content.
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from orchestrator.quiet import Quiet
from orchestrator.rollout_kind import Generate, Opening, RolloutKind, Toolkit, Trajectory, gather_or_cancel
from rl.config import RunConfig
from rl.dataset_config import Sampling

log = logging.getLogger("orchestrator")


@dataclass
class Turn:
    observation: str | None = None
    """The environment's reply, shown to the model before its next call."""
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


class EnvironmentKind(RolloutKind):
    """What the two environment kinds share (orchestrator/text_episodes.py, tool_episodes.py):
    rows from the environment's dataset(seed), group_size episodes per prompt (each failing on
    its own), the orchestrator's sampling settings for every turn. A kind adds `episode`, and
    `start_up`, its start-up checks (orchestrator/preflight.py)."""

    fit_keys = "orchestrator.max_tokens"
    """What a refusal for prompts too long to leave max_tokens tells the user to change."""

    def __init__(self, cfg: RunConfig, toolkit: Toolkit, renderer, sources, env):
        self.cfg, self.o, self.toolkit, self.env = cfg, cfg.orchestrator, toolkit, env
        self.env_sampling = self.o.sampling()
        self.error = ""  # the latest episode failure (Group.error)
        self.quiet = Quiet(log)  # an environment that always raises would say so per episode

    @classmethod
    @abstractmethod
    def start_up(cls, cfg: RunConfig, env) -> Callable[[object], Opening]:
        """Check what the kind needs of `env` (ConfigError naming the culprit); returns, for a
        tokenizer, how many tokens a row's opening prompt takes (orchestrator/prompt_fit.py)."""

    @abstractmethod
    async def episode(self, row: dict, eid: str, generate: Generate) -> Trajectory | None:
        """One episode; None if it failed on its own (`failed`)."""

    def draws(self, seed: int) -> Iterator[tuple[str, object]]:
        return (("", row) for row in self.env.dataset(seed))

    def fetch(self, source: str, draw) -> tuple[dict, str]:
        return draw, "orchestrator.environment"

    def sampling(self, prompt) -> Sampling:
        return self.env_sampling

    async def trajectories(self, prompt, gid: str, generate: Generate) -> list[Trajectory | None]:
        return await gather_or_cancel(self.episode(prompt.row, f"{gid}-e{i}", generate)
                                      for i in range(self.o.group_size))

    def failed(self, eid: str, e: Exception) -> None:
        """An episode that failed on its own: said (through Quiet), recorded, None for its slot."""
        self.error = f"{type(e).__name__}: {e}"
        self.quiet.warn(self.error, f"episode {eid} failed in {self.o.environment}: {self.error}")
        return None

    def last_error(self, prompt) -> str:
        return self.error

    def culprit(self, prompt) -> str:
        return f"orchestrator.environment = {self.o.environment!r}"

    def failure_fix(self, prompt) -> str:
        return "fix the environment's reward or episodes (the error above)"
