"""What the environment kinds share (orchestrator/rollout/text_environment.py, tool_environment.py): the
rows come from the environment's dataset(seed) (drawn by orchestrator/prompts/rows.py), a group is
group_size episodes that each fail on their own, and every turn samples with the orchestrator's
settings (orchestrator/rollout/kind.py)."""

from __future__ import annotations

import logging
from abc import abstractmethod
from collections.abc import Callable

from orchestrator.quiet_warning import Quiet
from orchestrator.rendering import Opening
from orchestrator.rollout.kind import Generate, RolloutKind, Toolkit, Trajectory, gather_or_cancel
from rl.config import RunConfig
from rl.config.datasets import Sampling

log = logging.getLogger("orchestrator")


class EnvironmentKind(RolloutKind):
    """What the two environment kinds share (orchestrator/rollout/text_environment.py, tool_environment.py):
    rows from the environment's dataset(seed), group_size episodes per prompt (each failing on
    its own), the orchestrator's sampling settings for every turn. A kind adds `episode`, and
    `start_up`, its start-up checks (orchestrator/preflight.py)."""

    fit_keys = "orchestrator.sampling.max_tokens"
    """What a refusal for prompts too long to leave max_tokens tells the user to change."""

    def __init__(self, cfg: RunConfig, toolkit: Toolkit, renderer, sources, env, rewards=None):
        self.cfg, self.settings, self.toolkit, self.env = cfg, cfg.orchestrator, toolkit, env
        self.env_sampling = self.settings.sampling_for()
        self.error = ""  # the latest episode failure (Group.error)
        self.quiet = Quiet(log)  # an environment that always raises would say so per episode

    @classmethod
    @abstractmethod
    def start_up(cls, cfg: RunConfig, env) -> Callable[[object], Opening]:
        """Check what the kind needs of `env` (ConfigError naming the culprit); returns, for a
        tokenizer, how many tokens a row's opening prompt takes (orchestrator/rendering/fit.py)."""

    @abstractmethod
    async def episode(self, row: dict, eid: str, generate: Generate) -> Trajectory | None:
        """One episode; None if it failed on its own (`failed`)."""

    def sampling(self, prompt) -> Sampling:
        return self.env_sampling

    async def trajectories(self, prompt, gid: str, generate: Generate) -> list[Trajectory | None]:
        return await gather_or_cancel(self.episode(prompt.row, f"{gid}-e{i}", generate)
                                      for i in range(self.settings.scheduling.group_size))

    def failed(self, eid: str, e: Exception) -> None:
        """An episode that failed on its own: said (through Quiet), recorded, None for its slot."""
        self.error = f"{type(e).__name__}: {e}"
        self.quiet.warn(self.error, f"episode {eid} failed in {self.settings.environment.class_}: {self.error}")
        return None

    def last_error(self, prompt) -> str:
        return self.error

    def culprit(self, prompt) -> str:
        return f"orchestrator.environment.class = {self.settings.environment.class_!r}"

    def failure_fix(self, prompt) -> str:
        return "fix the environment's reward or episodes (the error above)"
