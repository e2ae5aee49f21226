"""Rewards and datasets named in the config as `module:function`."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable


def load_callable(spec: str, key: str) -> Callable:
    """Resolve "package.module:function"; errors name the config key."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{key}: {spec!r} is not of the form 'module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{key}: cannot import {module_name!r} ({e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{key}: {module_name!r} has no function {attr!r}")
    return fn


async def score(reward_fn: Callable, prompt: str, completion: str, row: dict) -> float:
    """Call a sync or async reward function."""
    value = reward_fn(prompt, completion, row)
    if inspect.isawaitable(value):
        value = await value
    return float(value)
