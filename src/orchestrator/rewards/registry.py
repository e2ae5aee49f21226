"""The registry of reward kinds (orchestrator/rewards/reward.py Reward): a new kind is a file with its
class and one line here. A dataset's reward is chosen once, from its spec: a URL is an endpoint;
a function is async (a coroutine function), inline (orchestrator.reward_inline) or run on worker
threads."""

from __future__ import annotations

import inspect

import aiohttp

from orchestrator.callables import load_callable
from orchestrator.prompts.dataset_mix import Source
from orchestrator.rewards.async_function import AsyncReward
from orchestrator.rewards.http_endpoint import HttpReward
from orchestrator.rewards.inline_function import InlineReward
from orchestrator.rewards.reward import Reward
from orchestrator.rewards.threaded_function import ThreadedReward
from rl.config import RunConfig
from rl.config.datasets import BUILTIN_REWARDS

FUNCTION_REWARDS = {
    "async": AsyncReward,
    "inline": InlineReward,
    "threaded": ThreadedReward,
}


def make_reward(spec: str, timeout_s: float, session: aiohttp.ClientSession | None, inline: bool = False,
                key: str = "reward") -> Reward:
    """`key`: the config key that names the reward, for a function that does not load."""
    if spec.startswith(("http://", "https://")):
        return HttpReward(spec, timeout_s, session)
    fn = load_callable(BUILTIN_REWARDS.get(spec, spec), key)
    kind = "async" if inspect.iscoroutinefunction(fn) else "inline" if inline else "threaded"
    return FUNCTION_REWARDS[kind](spec, timeout_s, fn)


def configured_sources(cfg: RunConfig, session: aiohttp.ClientSession, evaluation: bool = False) -> list[Source]:
    """The run's training datasets (or, `evaluation`, its eval datasets), each with its reward."""
    o = cfg.orchestrator
    # The reward calls scoring at once: their sandboxed runs fit the sandbox's memory. Imported
    # here: orchestrator.rollout's package imports this one.
    from orchestrator.rollout.sandbox_budget import BUDGET

    BUDGET.configure(o.sandbox.memory_mb)
    sources = []
    for ds in o.resolved_datasets(evaluation):
        source = Source(ds, cfg.seed)
        key = f"dataset {ds.name}: reward"
        source.reward = make_reward(ds.reward, o.timeouts.reward_s, session, o.reward_inline, key) if ds.reward else None
        sources.append(source)
    return sources
