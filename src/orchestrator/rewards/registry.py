"""The registry of reward kinds (orchestrator/rewards/reward.py Reward): a new kind is a file with its
class and one line here. A dataset's reward is chosen once, from its spec: a URL is an endpoint;
a function is async (a coroutine function), inline (orchestrator.reward_inline) or run on worker
threads."""

from __future__ import annotations

import inspect

import aiohttp

from orchestrator.callables import load_callable
from orchestrator.rewards.async_function import AsyncReward
from orchestrator.rewards.http_endpoint import HttpReward
from orchestrator.rewards.inline_function import InlineReward
from orchestrator.rewards.reward import Reward
from orchestrator.rewards.threaded_function import ThreadedReward
from orchestrator.sandbox import BUDGET
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


def configured_rewards(cfg: RunConfig, session: aiohttp.ClientSession | None,
                       evaluation: bool = False) -> dict[str, Reward | None]:
    """The reward of each of the run's training datasets (or, `evaluation`, its eval datasets), by
    the dataset's name (None: a dataset without one)."""
    o = cfg.orchestrator
    # The reward calls scoring at once: their sandboxed runs fit the sandbox's memory.
    BUDGET.configure(o.sandbox.memory_mb)
    rewards = {}
    for ds in o.resolved_datasets(evaluation):
        key = f"dataset {ds.name}: reward"
        rewards[ds.name] = (make_reward(ds.reward, o.timeouts.reward_s, session, o.reward_inline, key)
                            if ds.reward else None)
    return rewards
