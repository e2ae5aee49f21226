"""Held-out evaluation of an environment ([[orchestrator.eval.environments]]; the datasets' is
orchestrator/evaluation/held_out.py, which runs both): `rows` rows of its dataset(seed) at the held-out
seed, `samples` episodes each, played by the environment's own kind (tool, text or external
agent) with the evaluation's sampling (greedy by default), on the server being evaluated. Per
environment: reward, accuracy (reward >= 1), pass@k as for datasets, and the episodes' means:
turns, tool calls, tool errors (and an agent's samples), and how many episodes failed."""

from __future__ import annotations

import asyncio
import itertools

from orchestrator.callables import load_callable
from orchestrator.rollout import kind_of
from rl.config.datasets import EvalConfig, EvalEnvironment
from rl.inference_api import GenerateRequest, GenerateResponse, InferenceClient


class EnvironmentEval:
    def __init__(self, rollouts, spec: EvalEnvironment, cfg: EvalConfig):
        run = rollouts.cfg
        o = run.orchestrator
        sampled = cfg.temperature > 0
        # The kind samples every turn with its settings' sampling(): the evaluation's here.
        sampling = o.sampling.model_copy(update={
            "temperature": cfg.temperature, "top_p": o.sampling.top_p if sampled else 1.0,
            "top_k": o.sampling.top_k if sampled else -1, "min_p": o.sampling.min_p if sampled else 0.0})
        settings = o.for_eval_environment(spec).model_copy(update={"sampling": sampling})
        env = load_callable(spec.class_, f"orchestrator.eval.environments {spec.name}: class")(**spec.args)
        self.kind = kind_of(env)(run.model_copy(update={"orchestrator": settings}), rollouts, rollouts.renderer, {}, env)
        self.name, self.samples = spec.name, cfg.samples
        # The same rows every time: a version's score is comparable with the one before.
        self.rows = list(itertools.islice(env.dataset(spec.seed), cfg.rows))

    async def run(self, client: InferenceClient, tag: str, gate: asyncio.Semaphore, adapter: str | None,
                  timeout_s: float, summary) -> dict:
        """eval/<name>/... of one version; `summary`: the datasets' (reward, accuracy, pass@k)."""

        async def generate(request: GenerateRequest) -> GenerateResponse:
            request = request.model_copy(update={"lora": adapter})  # None: the base weights
            async with gate:
                return await client.generate(request, timeout_s)

        episodes = await asyncio.gather(*(self.kind.episode(row, f"{tag}-{self.name}-{i}-{j}", generate)
                                          for i, row in enumerate(self.rows) for j in range(self.samples)))
        per_row = [episodes[i * self.samples:(i + 1) * self.samples] for i in range(len(self.rows))]
        scores = [[t.reward for t in row] for row in per_row if all(t is not None for t in row)]
        out = summary(self.name, scores)
        played = [t for t in episodes if t is not None]
        out[f"eval/{self.name}/failed"] = len(episodes) - len(played)
        for key in sorted({k for t in played for k in t.episode}):
            out[f"eval/{self.name}/{key}"] = sum(t.episode.get(key, 0.0) for t in played) / max(len(played), 1)
        return out
