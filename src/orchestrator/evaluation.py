"""Held-out evaluation (`[orchestrator.eval]`): greedy completions of the first rows of each
eval dataset, through the same rendering, stop tokens and reward as training, on a server
serving a known version. Training rewards are sampled at the training temperature and drawn
from the training rows; this is the number a person judges a run by.

A row's accuracy counts it right when its reward reaches 1 (the scorers shipped here give 1 for
a right answer, partial credit below); `reward` is the mean reward itself.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

from orchestrator.rollouts import Rollouts
from orchestrator.scoring import combine
from orchestrator.sources import RowError, Source
from rl.dataset_config import Sampling
from rl.inference_api import GenerateRequest, InferenceClient

log = logging.getLogger("orchestrator")

CONCURRENCY = 64  # requests in flight at once: enough to fill a server's batch


class Evaluation:
    def __init__(self, rollouts: Rollouts, sources: list[Source], rows: int, timeout_s: float):
        self.rollouts, self.sources, self.timeout_s = rollouts, sources, timeout_s
        # The same rows every time: a version's score is comparable with the one before.
        self.rows = {s.name: [s.fetch(d) for d in itertools.islice(s.draws(), rows)] for s in sources}

    async def run(self, client: InferenceClient, version: int, step: int, tag: str, adapter: str | None) -> dict:
        """Metrics for `version` (one record for metrics.jsonl); `adapter`: its LoRA name."""
        self.adapter = adapter
        start = time.monotonic()
        gate = asyncio.Semaphore(CONCURRENCY)
        record: dict = {"program": "eval", "step": step, "version": version}
        for source in self.sources:
            scores = await asyncio.gather(*(self.one(client, source, row, where, f"{tag}-{source.name}-{i}", gate)
                                            for i, (row, where) in enumerate(self.rows[source.name])))
            scored = [s for s in scores if s is not None]
            name = source.name
            record[f"eval/{name}/reward"] = sum(scored) / len(scored) if scored else float("nan")
            record[f"eval/{name}/accuracy"] = sum(s >= 1.0 for s in scored) / len(scored) if scored else float("nan")
            record[f"eval/{name}/rows"] = len(scored)
        record["eval_s"] = time.monotonic() - start
        return record

    async def one(self, client: InferenceClient, source: Source, row: dict, where: str, request_id: str,
                  gate: asyncio.Semaphore) -> float | None:
        s = source.ds.sampling
        greedy = Sampling(temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0, max_tokens=s.max_tokens, stop=s.stop)
        try:
            text, ids = self.rollouts.renderer.render(source.ds, row, where)
            request = self.rollouts.request(request_id, ids, 1, greedy)
            if self.adapter is not None:
                request = request.model_copy(update={"lora": self.adapter})
        except RowError as e:
            log.warning("eval row skipped: %s", e)
            return None
        async with gate:
            response = await client.generate(request, self.timeout_s)
        completion = self.rollouts.decode(response.samples[0].token_ids)
        (score,) = await source.reward.score(text, [completion], row)
        if score is None:
            return None
        weights = {**source.reward.weights, **source.ds.reward_weights}
        return combine(score, weights)[0]
