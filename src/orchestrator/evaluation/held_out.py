"""Held-out evaluation (`[orchestrator.eval]`): completions of the first rows of each eval
dataset, through the same rendering, stop tokens and reward as training, on the run's servers;
and episodes of each eval environment (orchestrator/evaluation/environments.py).
Training rewards are sampled at the training temperature from the training rows; this is the
number a person judges a run by.

It runs beside training: the orchestrator starts it as a task and goes on handing batches over;
at most eval.concurrency of its requests are in flight, so rollouts keep the rest of the servers.
A row's completion counts as right when its reward reaches 1 (the scorers shipped here give 1 for
a right answer, partial credit below). With n samples per row, pass@k is the unbiased estimate
1 - C(n-c, k) / C(n, k) averaged over rows (c right of n), for k = 1 and k = n.

`Evaluation` evaluates one version; `EvaluationRunner` runs those beside training, as tasks.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import aiohttp

from orchestrator import prometheus
from orchestrator.evaluation.environments import EnvironmentEval
from orchestrator.prompts import RowError, Source, configured_sources
from orchestrator.quiet_warning import Quiet
from orchestrator.rewards import Reward, combine, configured_rewards, weights_over
from orchestrator.rollout import Rollouts
from rl.config import RunConfig
from rl.config.datasets import EvalConfig, Sampling
from rl.inference_api import InferenceClient
from rl.rundir import RunDir

if TYPE_CHECKING:
    from orchestrator.servers import Server, ServerPool

log = logging.getLogger("orchestrator")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chance that at least one of k samples drawn from n (c of them right) is right."""
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


class Evaluation:
    def __init__(self, rollouts: Rollouts, sources: list[Source], cfg: EvalConfig, rewards: dict[str, Reward | None],
                 timeout_s: float):
        """`rewards`: the eval datasets' rewards, by the datasets' names (orchestrator/rewards/);
        `timeout_s`: orchestrator.timeouts.eval_s."""
        self.rollouts, self.sources, self.cfg, self.rewards, self.timeout_s = rollouts, sources, cfg, rewards, timeout_s
        self.quiet = Quiet(log)  # rows that cannot be rendered: a line per row, each evaluation, otherwise
        # The same rows every time: a version's score is comparable with the one before.
        self.rows = {s.name: [s.fetch(d) for d in itertools.islice(s.draws(), cfg.rows)] for s in sources}
        self.environments = [EnvironmentEval(rollouts, spec, cfg) for spec in cfg.environments]

    async def run(self, client: InferenceClient, version: int, step: int, tag: str, adapter: str | None) -> dict:
        """One record for metrics.jsonl: per dataset the mean reward, accuracy and pass@k of
        `version` (`adapter`: its LoRA name)."""
        start = time.monotonic()
        gate = asyncio.Semaphore(self.cfg.concurrency)
        record: dict = {"program": "eval", "step": step, "version": version}
        for source in self.sources:
            rows = self.rows[source.name]
            scores = await asyncio.gather(*(self.one(client, source, row, where, f"{tag}-{source.name}-{i}", gate,
                                                    adapter) for i, (row, where) in enumerate(rows)))
            record.update(self.summary(source.name, [s for s in scores if s is not None]))
        for env in self.environments:
            record.update(await env.run(client, f"{tag}-env", gate, adapter, self.timeout_s, self.summary))
        record["eval_s"] = time.monotonic() - start
        return record

    def summary(self, name: str, scores: list[list[float]]) -> dict:
        n = self.cfg.samples
        if not scores:
            return {f"eval/{name}/rows": 0}
        right = [sum(s >= 1.0 for s in row) for row in scores]
        out = {f"eval/{name}/reward": sum(map(sum, scores)) / (n * len(scores)),
               f"eval/{name}/accuracy": sum(right) / (n * len(scores)), f"eval/{name}/rows": len(scores)}
        if n > 1:
            for k in (1, n):
                out[f"eval/{name}/pass@{k}"] = sum(pass_at_k(n, c, k) for c in right) / len(scores)
        return out

    async def one(self, client: InferenceClient, source: Source, row: dict, where: str, request_id: str,
                  gate: asyncio.Semaphore, adapter: str | None) -> list[float] | None:
        """The row's n scores, or None if the row cannot be evaluated (or a reward failed)."""
        s = source.ds.sampling
        sampled = self.cfg.temperature > 0
        sampling = Sampling(temperature=self.cfg.temperature, top_p=s.top_p if sampled else 1.0,
                            top_k=s.top_k if sampled else -1, min_p=s.min_p if sampled else 0.0,
                            max_tokens=s.max_tokens, stop=s.stop)
        try:
            text, ids, images = self.rollouts.renderer.render(source.ds, row, where, source.image_roots)
            request = self.rollouts.request(request_id, ids, self.cfg.samples, sampling, where,
                                            self.rollouts.renderer.stop_token_ids, images=images)
        except RowError as e:
            self.quiet.warn(e.fix, f"eval row skipped: {e}")  # the same fix: the same cause
            return None
        # Scores only: no kept sets or routing to carry into a batch.
        request = request.model_copy(update={"kept_sets": False, "routed_experts": False, "lora": adapter})
        async with gate:
            response = await client.generate(request, self.timeout_s)
        completions = self.rollouts.decode_all([x.token_ids for x in response.samples])
        reward = self.rewards[source.name]
        scores = await reward.score(text, completions, row)
        if any(x is None for x in scores):
            return None
        return [combine(x, weights_over(reward, source.ds.reward_weights))[0] for x in scores]


class EvaluationRunner:
    """The evaluations running beside training, one task per version evaluated (`Evaluation`
    is None: no eval datasets, nothing runs)."""

    @classmethod
    def for_run(cls, cfg: RunConfig, session: aiohttp.ClientSession, rollouts: Rollouts, pool: ServerPool,
                run_dir: RunDir, wait_until: Callable[[Callable[[], bool], str, float], Awaitable[float]],
                tag: str) -> EvaluationRunner:
        """The run's evaluations: its eval datasets, each with its reward, and eval environments."""
        sources = configured_sources(cfg, evaluation=True)
        rewards = configured_rewards(cfg, session, evaluation=True)
        evaluated = sources or cfg.orchestrator.eval.environments
        return cls(Evaluation(rollouts, sources, cfg.orchestrator.eval, rewards,
                              cfg.orchestrator.timeouts.eval_s) if evaluated else None,
                   pool, run_dir, wait_until, tag)

    def __init__(self, evaluation: Evaluation | None, pool: ServerPool, run_dir: RunDir,
                 wait_until: Callable[[Callable[[], bool], str, float], Awaitable[float]], tag: str):
        """`wait_until`: the orchestrator's (it surfaces a background loop that died);
        `tag`: the orchestrator's request id prefix."""
        self.evaluation, self.pool, self.run_dir, self.wait_until, self.tag = evaluation, pool, run_dir, wait_until, tag
        self.tasks: list[asyncio.Task] = []  # running beside training
        # (server, version) of each evaluation running: LoRA keeps that adapter loaded until it ends
        # (between its requests no group may hold it, and unload_unused would take it away).
        self.pins: list[tuple[Server, int]] = []
        # Set once the starting weights' evaluation (step 0) ended, or when there is none. It runs
        # after the first batch, so as not to share the engine with it (the first step comes
        # seconds sooner), and the servers keep version 0 until it ends (follow_weights), so the
        # baseline is version 0's alone: batches 2..1+max_async_level may still use version 0.
        self.baseline_done = asyncio.Event()

    def start(self, step: int) -> None:
        """Evaluate the version `step` published, beside training."""
        if self.evaluation is None:
            self.baseline_done.set()
            return
        self.tasks.append(asyncio.create_task(self.evaluate(step), name=f"evaluate-{step}"))

    def no_baseline(self) -> None:
        """A resumed run: its starting weights were evaluated by the run it resumes."""
        self.baseline_done.set()

    async def finish(self, final: int) -> None:
        """Once the final version serves: the evaluations still running end, then it is evaluated."""
        await asyncio.gather(*self.tasks)  # each bounded by orchestrator.timeouts.eval_s
        if self.evaluation is not None:
            await self.evaluate(final)

    async def evaluate(self, step: int) -> None:
        """One evaluation of version `step` (or the newest serving once it does); a failure is
        logged and the run goes on."""
        try:
            await self.evaluate_once(step)
        finally:
            if step == 0:
                self.baseline_done.set()

    async def evaluate_once(self, step: int) -> None:
        timeout_s = self.evaluation.timeout_s
        try:
            await self.wait_until(lambda: self.pool.serving_version >= step and self.pool.pick() is not None,
                                  f"version {step} to serve, to evaluate it", timeout_s)
            server = self.pool.pick()
            version = server.version
            pin = (server, version)
            self.pins.append(pin)
            try:
                async with asyncio.timeout(timeout_s):  # not wait_for: it can lose a cancel (orchestrator.bounded_wait)
                    record = await self.evaluation.run(server.client, version, step, f"{self.tag}-eval{step}",
                                                       self.pool.delivery.adapter(version))
            finally:
                self.pins.remove(pin)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the run goes on without this evaluation
            log.warning("evaluation at step %d failed (%s: %s); the run goes on", step, type(e).__name__, e)
            return
        record["version_end"] = server.version  # a long evaluation may see the next version land
        self.run_dir.append_metrics(record)
        prometheus.evaluated(record)
        scores = ", ".join(f"{k.removeprefix('eval/')} {v:.3f}" for k, v in record.items()
                           if k.startswith("eval/") and not k.endswith("/rows"))
        log.info("eval of version %d (step %d): %s (%.1f s)", version, step, scores, record["eval_s"])
