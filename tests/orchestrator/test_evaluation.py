"""Held-out evaluation (orchestrator/evaluation/held_out.py): n samples per row scored by the dataset's
reward, accuracy and the unbiased pass@k estimate computed from them, greedy with one sample."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from conftest import TINY_MODEL
from fake_inference import FakeServer, with_server
from orchestrator.evaluation.held_out import Evaluation, pass_at_k
from orchestrator.prompts.dataset_mix import Source
from orchestrator.rendering.tokenizer import load_tokenizer
from orchestrator.rewards.registry import make_reward
from orchestrator.rollout.groups import Rollouts
from rl.config import ConfigError, RunConfig, load_config
from rl.inference_api import connector


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
        "datasets": [{"name": "d", "function": "tasks.reverse:dataset", "reward": "test_evaluation:has_a",
                      "sampling": {"max_tokens": 3}}]}}})
    server = FakeServer()

    async def body(client, session):
        sources = [Source(d, cfg.seed) for d in cfg.orchestrator.resolved_datasets(evaluation=True)]
        rewards = {s.name: make_reward(s.ds.reward, 5.0, session, inline=True, key="r") for s in sources}
        rollouts = Rollouts(cfg, load_tokenizer(str(TINY_MODEL)), {}, None, None)  # renders, as in a run
        return await Evaluation(rollouts, sources, cfg.orchestrator.eval, rewards, cfg.orchestrator.timeouts.eval_s).run(client, 3, 7, "t", None)

    record = asyncio.run(with_server(server, body))
    assert all(r.n == 4 and r.prompt for r in server.requests.values()) and len(server.requests) == 6
    rows = list(SEEN.values())
    assert len(rows) == 6 and all(len(r) == 4 for r in rows)
    right = [int(sum(r)) for r in rows]
    assert (record["step"], record["version"], record["eval/d/rows"]) == (7, 3, 6)
    assert record["eval/d/accuracy"] == pytest.approx(sum(right) / 24)
    assert record["eval/d/pass@1"] == pytest.approx(sum(right) / 24)
    assert record["eval/d/pass@4"] == pytest.approx(sum(c > 0 for c in right) / 6)


def test_eval_datasets_beside_a_text_environment_render_and_stop_as_datasets_do():
    """A text environment trains in raw text (no renderer, no stop ids of its own); its eval
    datasets are still rendered, and end where the model's turns end, as in a datasets run."""
    from tasks.guess_letter import GuessLetter

    SEEN.clear()
    cfg = RunConfig.model_validate({"model": str(TINY_MODEL), "seq_len": 64, "orchestrator": {
        "environment": {"class": "tasks.guess_letter:GuessLetter"}, "eval": {
            "rows": 2, "samples": 1, "datasets": [{"name": "d", "function": "tasks.reverse:dataset",
                                                   "reward": "test_evaluation:has_a", "sampling": {"max_tokens": 3}}]}}})
    server = FakeServer()

    async def body(client, session):
        sources = [Source(d, cfg.seed) for d in cfg.orchestrator.resolved_datasets(evaluation=True)]
        rewards = {s.name: make_reward(s.ds.reward, 5.0, session, inline=True, key="r") for s in sources}
        rollouts = Rollouts(cfg, load_tokenizer(str(TINY_MODEL)), {}, None, GuessLetter())
        assert rollouts.kind.stop_token_ids == []  # the environment's own requests
        return rollouts, await Evaluation(rollouts, sources, cfg.orchestrator.eval, rewards, cfg.orchestrator.timeouts.eval_s).run(client, 0, 1, "t", None)

    rollouts, record = asyncio.run(with_server(server, body))
    assert record["eval/d/rows"] == 2 and len(SEEN) == 2
    assert rollouts.renderer.stop_token_ids  # the tiny model's eos
    assert all(r.stop_token_ids == rollouts.renderer.stop_token_ids for r in server.requests.values())


def test_greedy_evaluation_with_several_samples_is_refused(write_toml):
    with pytest.raises(ConfigError, match="eval.samples > 1 needs eval.temperature > 0"):
        load_config(["@", str(write_toml('model = "m"\n')), "--orchestrator.eval.samples", "4"])


@pytest.mark.slow
def test_a_greedy_evaluation_on_a_real_engine_takes_one_sample_per_row_and_repeats_itself(tmp_path):
    """The default evaluation (greedy) against a real vLLM server: each row is one request for
    one sample at temperature 0 with no truncation, the engine answers one completion, the reward
    scores it once; evaluated again after a reload of the same weights (a fresh prefix-cache
    salt, so nothing computed by the first pass seeds the second; one request at a time, so
    each is computed alone both times), every row's greedy ids are the same and so is the
    record's accuracy."""
    import shutil

    from rl.inference_api import InferenceClient
    from rl.rundir import RunDir
    from programs import start_server

    SEEN.clear()
    run = RunDir(tmp_path / "run")
    server, url = start_server(tmp_path, "server", TINY_MODEL, run.root)
    cfg = RunConfig.model_validate({"model": str(TINY_MODEL), "seq_len": 64, "orchestrator": {"eval": {
        "rows": 6, "concurrency": 1,
        "datasets": [{"name": "d", "function": "tasks.reverse:dataset", "reward": "test_evaluation:has_a",
                      "sampling": {"max_tokens": 12}}]}}})
    calls: list[tuple] = []

    async def body():
        async with aiohttp.ClientSession(connector=connector()) as session:
            client = InferenceClient(url, session)
            real_generate = client.generate

            async def observed(request, timeout):
                response = await real_generate(request, timeout)
                calls.append((request.request_id, request.n, request.temperature, request.top_k, request.top_p,
                              request.min_p, [s.token_ids for s in response.samples]))
                return response

            client.generate = observed
            sources = [Source(d, cfg.seed) for d in cfg.orchestrator.resolved_datasets(evaluation=True)]
            rewards = {s.name: make_reward(s.ds.reward, 5.0, session, inline=True, key="r") for s in sources}
            rollouts = Rollouts(cfg, load_tokenizer(str(TINY_MODEL)), {}, None, None)
            evaluation = Evaluation(rollouts, sources, cfg.orchestrator.eval, rewards, cfg.orchestrator.timeouts.eval_s)
            first = await evaluation.run(client, 0, 0, "a", None)
            shutil.copytree(TINY_MODEL, run.weights_dir(1))
            async with session.post(f"{url}/update_weights",
                                    json={"path": str(run.weights_dir(1)), "version": 1, "mode": "wait"}) as r:
                assert r.status == 200, await r.text()
            second = await evaluation.run(client, 1, 1, "b", None)
            return first, second

    try:
        first, second = asyncio.run(body())
    finally:
        server.stop()
    assert len(calls) == 12
    for _, n, temperature, top_k, top_p, min_p, samples in calls:
        assert (n, temperature, top_k, top_p, min_p) == (1, 0.0, -1, 1.0, 0.0)
        assert len(samples) == 1 and samples[0]
    assert len(SEEN) == 6 and all(len(scores) == 2 for scores in SEEN.values())  # one score per row per pass
    ids = {rid: samples[0] for rid, *_, samples in calls}
    firsts = {rid.split("-", 1)[1]: v for rid, v in ids.items() if rid.startswith("a-")}
    seconds = {rid.split("-", 1)[1]: v for rid, v in ids.items() if rid.startswith("b-")}
    assert len(firsts) == len(seconds) == 6 and firsts == seconds
    assert first["eval/d/rows"] == second["eval/d/rows"] == 6
    assert first["eval/d/accuracy"] == second["eval/d/accuracy"]
