"""A failing episode costs that episode, not its group (issue 52, item 6): an agent that raises
(before asking, after its answers, or giving up while the model still generates its request), a
text environment whose step raises, a reward that raises. The group trains on the episodes that
finished, advantages over those, when at least orchestrator.scheduling.min_group_episodes did; fewer fail
the group as before. Each batch's record says how many episodes failed and how many groups
were kept short."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from conftest import ROOT
from fake_inference import FakeServer, tiny_config, with_server
from orchestrator.prompts.queue import Prompt
from orchestrator.rendering.tokenizer import load_tokenizer
from orchestrator.rollout.advantages import group_advantages
from orchestrator.rollout.environment import Turn
from orchestrator.rollout.groups import Rollouts
from rl.config import load_config
from rl.inference_api import GeneratedSample, GenerateResponse
from scenarios import DATASET, run_scenario
from tasks.calculator_agent import CalculatorAgent


DOOMED = "doomed"


class FlakyAgent(CalculatorAgent):
    """The first `doomed` episodes to start fail as `mode` says; every other one asks once and
    returns its own reward (1, 2, 3, ...: the advantages show over whom they were taken)."""

    def __init__(self, mode: str, doomed: int):
        self.mode, self.doomed = mode, doomed
        self.calls, self.rewards = itertools.count(), itertools.count(1)
        self.asked = asyncio.Event()  # a doomed request reached the model
        self.gave_up = asyncio.Event()  # the doomed agent went away mid-request

    async def agent(self, row, access):
        doomed = next(self.calls) < self.doomed
        if doomed and self.mode == "before":
            raise RuntimeError("the agent's bug, before any request")
        question = DOOMED if doomed else row["prompt"]
        async with access.client() as client:
            ask = client.chat.completions.create(model=access.model, messages=[{"role": "user", "content": question}])
            if doomed and self.mode == "in flight":
                request = asyncio.ensure_future(ask)
                await self.asked.wait()
                request.cancel()  # the client drops its connection while the model generates
                self.gave_up.set()
                raise TimeoutError("the agent's own deadline")
            await ask
        if doomed:
            raise RuntimeError("the agent's bug, after its answers")
        return float(next(self.rewards))


def agent_group(mode: str, doomed: int, **orchestrator):
    """(the rollouts, one group of group_size episodes of which `doomed` fail, on a scripted model)."""
    keys = [x for k, v in orchestrator.items() for x in (f"--orchestrator.scheduling.{k}", str(v))]
    cfg, _ = load_config(["@", str(ROOT / "configs" / "tools_demo.toml"), "--orchestrator.environment.class",
                          "tasks.calculator_agent:CalculatorAgent", *keys])
    agent = FlakyAgent(mode, doomed)
    rollouts = Rollouts(cfg, load_tokenizer(cfg.model), {}, None, agent)
    written = rollouts.encode("4", add_special_tokens=False) + rollouts.kind.stop_token_ids[:1]

    async def generate(request):
        if agent.mode == "in flight" and DOOMED in rollouts.decode(request.prompt_token_ids):
            agent.asked.set()
            await agent.gave_up.wait()  # still generating when the agent goes away
        return GenerateResponse(samples=[GeneratedSample(token_ids=written, logprobs=[-0.5] * len(written),
                                                         versions=[0] * len(written), finish_reason="stop")])

    async def main():
        try:
            return await rollouts.group(Prompt(0, {"prompt": "Calculate 2+2.", "answer": "4"}), "g", generate)
        finally:
            await rollouts.kind.endpoint.stop()

    return rollouts, asyncio.run(main())


@pytest.mark.parametrize("mode", ["before", "after", "in flight"])
def test_an_agent_failing_one_episode_keeps_its_group_with_the_rest(mode):
    rollouts, group = agent_group(mode, doomed=1)
    assert (group.failed, len(group.samples), group.short) == (1, 7, True)
    rewards = [float(r) for r in range(1, 8)]
    assert sorted(group.rewards) == rewards
    # Advantages over the seven that finished, not over eight with a hole.
    by_reward = dict(zip(rewards, group_advantages(rewards, rollouts.settings.scheduling.normalize_advantages)))
    for s in group.samples:
        trained = [a for a, m in zip(s.advantages, s.loss_mask) if m]
        assert trained and all(a == pytest.approx(by_reward[s.reward]) for a in trained)


def test_a_group_left_below_min_group_episodes_fails_as_before():
    _, group = agent_group("after", doomed=2, min_group_episodes=7)
    assert (group.samples, group.failed, group.short) == ([], 8, False)
    assert "the agent's bug, after its answers" in group.error
    _, group = agent_group("after", doomed=2, min_group_episodes=6)
    assert (len(group.samples), group.failed, group.short) == (6, 2, True)


def test_min_group_episodes_above_group_size_is_refused():
    with pytest.raises(ValueError, match="more than group_size"):
        tiny_config(scheduling={"group_size": 4, "min_group_episodes": 5})


class SometimesRaising:
    """A text environment whose step raises in one episode of each group (the first to step)."""

    def __init__(self):
        self.steps = itertools.count()

    def dataset(self, seed):
        while True:
            yield {}

    def episode(self, row):
        return self

    def start(self):
        return "guess="

    def step(self, text):
        n = next(self.steps)
        if n == 0:
            raise RuntimeError("the environment's bug")
        return Turn(reward=float(n), done=True)


def test_a_text_environment_whose_step_raises_costs_that_episode():
    cfg = tiny_config(environment={"class": "test_failing_episodes:SometimesRaising", "max_turns": 2},
                 sampling={"max_tokens": 2}, scheduling={"group_size": 4})

    async def body(client, session):
        rollouts = Rollouts(cfg, load_tokenizer(cfg.model), {}, None, SometimesRaising())
        return await rollouts.group(Prompt(0, {}), "g1", lambda r: client.generate(r, 10))

    group = asyncio.run(with_server(FakeServer(), body))
    assert (group.failed, sorted(group.rewards), group.short) == (1, [1.0, 2.0, 3.0], True)


def test_the_batch_record_counts_failed_episodes_and_short_groups(tmp_path):
    """Rewards raise on 30% of rollouts (tests/fake_inference.py flaky_reward): each batch's
    groups are short by exactly the episodes its record says failed."""
    o = asyncio.run(run_scenario(tmp_path / "a", [FakeServer(lambda: 0.0005)], max_steps=3, orchestrator={
        "datasets": [{**DATASET, "reward": "fake_inference:flaky_reward"}], "scheduling": {"group_size": 4}}))
    records = {r["step"]: r for r in o.metrics if r["program"] == "orchestrator"}
    for step, batch in o.batches.items():
        r = records[step]
        assert batch.num_samples == 4 * 4 - r["episodes_failed_batched"]
        assert r["groups_short"] <= r["episodes_failed_batched"] and (r["groups_short"] > 0) == (r["episodes_failed_batched"] > 0)
    assert sum(r["groups_short"] for r in records.values()) > 0
