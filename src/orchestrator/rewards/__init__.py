"""The rewards station: a completion in, a float out. The interface is reward.py (Reward, one kind per
dataset, chosen once at start-up by registry.py); the kinds: threaded_function.py (a sync function on
worker threads, the default), inline_function.py, async_function.py, http_endpoint.py. A new kind: a
file and a line in registry.py."""

# The station's interface, as the other stations use it.
from orchestrator.rewards.registry import configured_sources
from orchestrator.rewards.reward import Teacher, combine

__all__ = ["Teacher", "combine", "configured_sources"]
