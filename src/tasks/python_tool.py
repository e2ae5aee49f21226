"""A `python` tool for tool environments: the model's code runs in orchestrator/sandbox/sandbox.py
(bubblewrap's namespaces: no network, no host process, no file of the repository or the run, a
scratch directory of its own; and its limits) and the tool answers with what it printed, and why
it stopped when it did not end well ("[timed out]", "[out of memory]", ...). An environment that
lists it executes model-written code: start-up checks the isolation (orchestrator/preflight.py).

    class MyEnv:
        tools = [python]
"""

from __future__ import annotations

import logging

from orchestrator.sandbox.sandbox import Limits, Sandbox

SANDBOX = Sandbox(Limits(wall_s=10, cpu_s=5, memory_mb=512, output_bytes=4096))
log = logging.getLogger("orchestrator")
_said = []


async def python(code: str) -> str:
    """Run a Python program and return what it prints.

    Args:
        code: The program; print what you want to see.
    """
    if not _said and (why := Sandbox.isolation()):
        _said.append(why)
        log.warning("python tool: %s", why)
    return (await SANDBOX.run(code)).for_model()
