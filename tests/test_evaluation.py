"""Held-out evaluation (orchestrator/evaluation.py): n samples per row scored by the dataset's
reward, accuracy and the unbiased pass@k estimate computed from them, greedy with one sample."""

from __future__ import annotations

import asyncio

import pytest

from conftest import TINY_MODEL
from fake_inference import FakeServer
from orchestrator.evaluation import Evaluation, pass_at_k
from orchestrator.rollouts import Rollouts
from orchestrator.scoring import Reward
from orchestrator.sources import Source
from orchestrator.tokenizer import load_tokenizer
from rl.config import ConfigError, RunConfig, load_config
from test_rollouts import with_server

SEEN: dict[str, list[float]] = {}


def has_a(prompt, completion, row):
    score = float("a" in completion)
    SEEN.setdefault(row["prompt"], []).append(score)
    return score


def test_pass_at_k_is_the_unbiased_estimate():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 4) == 1.0  # one right among the 4 drawn: always found
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)


def test_samples_per_row_give_accuracy_and_pass_at_k():
    SEEN.clear()
    cfg = RunConfig.model_validate({"model": str(TINY_MODEL), "seq_len": 64, "orchestrator": {"eval": {
        "rows": 6, "samples": 4, "temperature": 1.0, "concurrency": 2,
        "datasets": [{"name": "d", "function": "orchestrator.tasks.reverse:dataset", "reward": "test_evaluation:has_a",
                      "max_tokens": 3}]}}})
    server = FakeServer()

    async def body(client, session):
        sources = [Source(d, cfg.seed) for d in cfg.orchestrator.resolved_datasets(evaluation=True)]
        for s in sources:
            s.reward = Reward(s.ds.reward, 5.0, session, inline=True, key="r")
        rollouts = Rollouts(cfg, load_tokenizer(str(TINY_MODEL)), {}, None, None)  # renders, as in a run
        return await Evaluation(rollouts, sources, cfg.orchestrator.eval).run(client, 3, 7, "t", None)

    record = asyncio.run(with_server(server, body))
    assert all(r.n == 4 and r.prompt for r in server.requests.values()) and len(server.requests) == 6
    rows = list(SEEN.values())
    assert len(rows) == 6 and all(len(r) == 4 for r in rows)
    right = [int(sum(r)) for r in rows]
    assert (record["step"], record["version"], record["eval/d/rows"]) == (7, 3, 6)
    assert record["eval/d/accuracy"] == pytest.approx(sum(right) / 24)
    assert record["eval/d/pass@1"] == pytest.approx(sum(right) / 24)
    assert record["eval/d/pass@4"] == pytest.approx(sum(c > 0 for c in right) / 6)


def test_greedy_evaluation_takes_one_sample(write_toml):
    with pytest.raises(ConfigError, match="eval.samples > 1 needs eval.temperature > 0"):
        load_config(["@", str(write_toml('model = "m"\n')), "--orchestrator.eval.samples", "4"])
