"""The rewards station: a completion in, a float out. The interface is reward.py (Reward, one kind per
dataset, chosen once at start-up by registry.py); the kinds: threaded_function.py (a sync function on
worker threads, the default), inline_function.py, async_function.py, http_endpoint.py. A new kind: a
file and a line in registry.py."""
