"""The datasets kind (no orchestrator.environment.class): a prompt rendered from a dataset's row, one
request of group_size completions, each scored by the dataset's reward (orchestrator/rewards/reward.py)."""

from __future__ import annotations

import time

from orchestrator import prometheus
from orchestrator.prompts import Prompt, RowError, Source
from orchestrator.rendering import ImageError, Renderer, check_expanded
from orchestrator.rewards import Reward, combine, weights_over
from orchestrator.rollout.kind import Aborted, Generate, RolloutKind, Toolkit, Trajectory
from rl.config import RunConfig
from rl.config.datasets import Sampling


class SingleTurn(RolloutKind):
    def __init__(self, cfg: RunConfig, toolkit: Toolkit, renderer: Renderer, sources: dict[str, Source], env=None,
                 rewards: dict[str, Reward | None] | None = None):
        self.settings, self.toolkit, self.renderer, self.sources = cfg.orchestrator, toolkit, renderer, sources
        self.rewards = rewards or {}
        self.stop_token_ids = renderer.stop_token_ids

    def reward(self, source: Source) -> Reward | None:
        return self.rewards.get(source.name)

    def source(self, prompt: Prompt) -> Source:
        # "": a prompt checkpointed before datasets had names, when there was only one.
        return self.sources[prompt.source] if prompt.source else next(iter(self.sources.values()))

    def sampling(self, prompt: Prompt) -> Sampling:
        return self.source(prompt).ds.sampling

    async def trajectories(self, prompt: Prompt, gid: str, generate: Generate) -> list[Trajectory | None]:
        source = self.source(prompt)
        where = prompt.where or f"row {prompt.index}"
        text, ids, images = self.renderer.render(source.ds, prompt.row, where, source.image_roots)
        request = self.toolkit.request(gid, ids, self.settings.scheduling.group_size, source.ds.sampling,
                                       f"{prompt.where or source.name}, draw {prompt.index}", images=images)
        response = await generate(request)
        if any(s.finish_reason == "abort" for s in response.samples):
            raise Aborted(gid)
        if images is not None:
            try:  # the prompt the server sampled after must be the one the trainer scores
                check_expanded(images, response.prompt_token_ids, where)
            except ImageError as e:
                raise RowError(str(e), "the server's processor differs from the model's processor_config.json",
                               image=True) from None
        completions = self.toolkit.decode_all([s.token_ids for s in response.samples])
        scoring = time.monotonic()
        reward = self.reward(source)
        scores = await reward.score(text, completions, prompt.row) if reward else [0.0] * len(completions)
        prometheus.REWARD_SECONDS.observe(time.monotonic() - scoring)
        out = []
        for s, score in zip(response.samples, scores):
            if score is None:
                out.append(None)
                continue
            value, components = combine(score, weights_over(reward, source.ds.reward_weights))
            t = Trajectory([], [], [], [], value, components, s.finish_reason == "length")
            t.reward -= self.overlong_penalty(len(s.token_ids), request.max_tokens, t)
            t.add(ids)
            t.add(s.token_ids, s)
            t.images = images.images if images is not None else []
            out.append(t)
        return out

    def overlong_penalty(self, length: int, max_tokens: int, t: Trajectory) -> float:
        """DAPO's soft overlong punishment: 0 up to max_tokens - overlong.buffer, then growing
        linearly to overlong.penalty at max_tokens (logged as a reward component)."""
        if self.settings.overlong.mode != "penalty":
            return 0.0
        buffer = min(self.settings.overlong.buffer, max_tokens)
        penalty = self.settings.overlong.penalty * max(0, length - (max_tokens - buffer)) / buffer
        t.components = {**t.components, "overlong_penalty": -penalty}
        return penalty

    def last_error(self, prompt: Prompt) -> str:
        reward = self.reward(self.source(prompt))
        return f"reward {reward.spec} {reward.last_error}" if reward and reward.last_error else ""

    def culprit(self, prompt: Prompt) -> str:
        return f"dataset {self.source(prompt).name}"

    def failure_fix(self, prompt: Prompt) -> str:
        reward = self.source(prompt).ds.reward
        teacher = f" or the teacher at {self.settings.teacher.url}" if self.settings.teacher.url else ""
        return f"fix its reward {reward!r}{teacher} (the error above), or orchestrator.timeouts.reward_s if it is slow"
