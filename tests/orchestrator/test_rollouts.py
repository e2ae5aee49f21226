"""From prompt to scored group (orchestrator/rollout/groups.py): multi-turn episodes, pluggable rewards
(callable, HTTP endpoint, failures) and the teacher's per-token signal, against stand-in servers
(tests/fake_inference.py; tests/inference/test_inference_server.py runs an episode on real vLLM)."""

from __future__ import annotations

import asyncio
import threading

import aiohttp
import pytest
from aiohttp import web

from conftest import TINY_MODEL, free_port
from fake_inference import FakeServer, score_over_http, start, tiny_config, with_server
from orchestrator.prompts.dataset_mix import Source
from orchestrator.prompts.queue import Prompt
from orchestrator.rendering.tokenizer import load_tokenizer
from orchestrator.rewards.registry import make_reward
from orchestrator.rewards.reward import Teacher
from orchestrator.rollout.environment import Turn
from orchestrator.rollout.groups import Rollouts
from rl.config import RunConfig
from rl.inference_api import InferenceClient, connector
from tasks.guess_letter import Game, GuessLetter


TOKENIZER = load_tokenizer(str(TINY_MODEL))


def unscored_sources(cfg: RunConfig) -> dict[str, Source]:
    """The config's datasets with no reward (every rollout scores 0)."""
    return {d.name: Source(d, cfg.seed) for d in cfg.orchestrator.resolved_datasets()}


def test_guess_letter_game():
    game = Game("m")
    assert game.start() == "guess="
    assert game.step("c") == Turn(observation="up=")
    assert game.step("==") == Turn(observation="guess=")  # no letter: asked again
    assert game.step("q") == Turn(observation="down=")
    end = game.step("mx")
    assert end.done and end.reward == pytest.approx(0.7)  # found at the 4th guess
    rows = GuessLetter().dataset(3)
    assert [next(rows) for _ in range(3)] == [next(r) for r in [GuessLetter().dataset(3)] for _ in range(3)]


class AlwaysWrong:
    """Every guess is wrong: each episode runs all max_turns turns."""

    def dataset(self, seed):
        while True:
            yield {"secret": "="}

    def episode(self, row):
        return Game(row["secret"])


def test_multi_turn_episode_interleaves_model_and_environment_tokens():
    cfg = tiny_config(environment={"class": "test_rollouts:AlwaysWrong", "max_turns": 3}, sampling={"max_tokens": 2},
                 scheduling={"group_size": 2})
    server = FakeServer()

    async def body(client, session):
        rollouts = Rollouts(cfg, TOKENIZER, {}, None, AlwaysWrong())
        return await rollouts.group(Prompt(0, {"secret": "="}), "g1", lambda r: client.generate(r, 10))

    group = asyncio.run(with_server(server, body))
    assert len(group.samples) == 2 and group.failed == 0
    for s in group.samples:
        model = [t for t, m in zip(s.tokens, s.loss_mask) if m]
        assert len(model) == 3 * 2  # three turns of two tokens
        # The layout: prompt, model, observation, model, observation, model.
        runs = [m for i, m in enumerate(s.loss_mask) if i == 0 or m != s.loss_mask[i - 1]]
        assert runs == [0, 1, 0, 1, 0, 1]
        text = TOKENIZER.decode([t for t, m in zip(s.tokens, s.loss_mask) if not m])
        assert text.startswith("guess=") and ("up=" in text or "down=" in text)
        assert all(v == 0 for v, m in zip(s.versions, s.loss_mask) if m)
        assert all(v == -1 for v, m in zip(s.versions, s.loss_mask) if not m)
    # Each turn's request carried the whole episode so far.
    prompts = sorted((len(r.prompt) for r in server.requests.values()))
    assert len(prompts) == 6 and prompts[0] < prompts[2] < prompts[4]


def test_rewards_from_an_http_endpoint_and_failures_counted():
    calls = []

    async def score(request):
        body = await request.json()
        calls.append(body)
        if body["completion"].startswith(("a", "b", "c")):
            return web.json_response({"error": "boom"}, status=500)
        return web.json_response({"reward": len(body["completion"]) / 10})

    assert asyncio.run(score_over_http(score, 5, "xy=", ["abc", "xyz", "zz"], {"prompt": "xy=", "k": 1})) == [None, 0.3, 0.2]
    assert calls[1] == {"prompt": "xy=", "completion": "xyz", "row": {"prompt": "xy=", "k": 1}}


async def slow_reward(prompt, completion, row):
    await asyncio.Event().wait()  # only the timeout's cancellation ends it
    return 1.0


hung_released = threading.Event()


def hung_sync_reward(prompt, completion, row):
    hung_released.wait(60)  # released by the test once answered: it cannot return before that
    return 1.0


@pytest.mark.parametrize("spec", ["test_rollouts:slow_reward", "test_rollouts:hung_sync_reward"])
def test_a_reward_that_times_out_fails_its_rollouts(spec):
    async def scenario():
        async with aiohttp.ClientSession(connector=connector()) as session:
            return await make_reward(spec, 0.2, session).score("p", ["a", "b"], {})

    hung_released.clear()
    try:
        assert asyncio.run(scenario()) == [None, None]
    finally:
        hung_released.set()


def test_teacher_logprobs_become_per_token_advantages():
    """The fake policy samples every token at logprob -3.2 and the fake teacher scores every
    token at -0.5: each model token gains coef * (-0.5 - -3.2) on top of its reward advantage."""
    cfg = tiny_config(scheduling={"group_size": 2}, sampling={"max_tokens": 4}, teacher={"url": "http://unused", "coef": 0.5},
                 datasets=[{"name": "data", "function": "tasks.reverse:dataset"}])  # no reward: the teacher alone
    policy, teacher = FakeServer(), FakeServer()

    async def scenario():
        tport = free_port()
        trunner = await start(teacher, tport)
        try:
            async def body(client, session):
                t = Teacher(InferenceClient(f"http://127.0.0.1:{tport}", session), 0.5, 10)
                rollouts = Rollouts(cfg, TOKENIZER, unscored_sources(cfg), t, None)
                return await rollouts.group(Prompt(0, {"prompt": "abc="}), "g", lambda r: client.generate(r, 10))
            return await with_server(policy, body)
        finally:
            await trunner.cleanup()

    group = asyncio.run(scenario())
    for s in group.samples:
        model_adv = [a for a, m in zip(s.advantages, s.loss_mask) if m]
        assert model_adv == pytest.approx([0.5 * (-0.5 + 3.2)] * 4)
        assert all(a == 0 for a, m in zip(s.advantages, s.loss_mask) if not m)
    # The teacher saw the student's whole sequences.
    assert sorted(len(r.prompt) for r in teacher.requests.values()) == [len(s.tokens) for s in group.samples]
