"""`package.module:name` specs (a dataset's function and reward, orchestrator.environment.class): resolved in one
place, so that the start-up check (orchestrator/preflight.py) and the orchestrator that calls them agree.

The current directory is importable, as it is under `python -m asyncrl`: the `rl` console script
would otherwise not find a user's `mytask.py` beside the config while `rl run`'s children
(started with `python -m asyncrl`) would.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable

from rl.config import ConfigError


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def load_callable(spec: str, key: str) -> Callable:
    """Import "package.module:name" and return the callable; ConfigError names the key."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"{key} = {spec!r}: expected 'package.module:name'")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):  # the module itself (or its package) is missing
            raise ConfigError(f"{key} = {spec!r}: no module named {e.name!r} (install it, or run from the "
                              "directory that holds it)") from None
        raise ConfigError(f"{key} = {spec!r}: importing {module_name!r} failed: {_first_line(e)}") from None
    except Exception as e:  # a module whose own code fails: SyntaxError, NameError, ...
        raise ConfigError(f"{key} = {spec!r}: importing {module_name!r} failed: {_first_line(e)}") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise ConfigError(f"{key} = {spec!r}: module {module_name!r} has no {attr!r}")
    if not callable(fn):
        raise ConfigError(f"{key} = {spec!r}: {attr!r} in {module_name!r} is a {type(fn).__name__}, not callable")
    return fn
