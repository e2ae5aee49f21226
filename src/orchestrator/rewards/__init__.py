"""The rewards station: a completion in, a float out. The interface is reward.py (Reward, one kind per
dataset, chosen once at start-up by registry.py); the kinds: threaded_function.py (a sync function on
worker threads, the default), inline_function.py, async_function.py, http_endpoint.py. A new kind: a
file and a line in registry.py. It takes text, completions and a row; it knows nothing of where rows
come from or how they were rendered (rewards that run code use the sandbox station)."""

# The station's interface, as the other stations use it.
from orchestrator.rewards.registry import configured_rewards, make_reward
from orchestrator.rewards.reward import Reward, Teacher, combine, weights_over

__all__ = ["Reward", "Teacher", "combine", "configured_rewards", "make_reward", "weights_over"]
