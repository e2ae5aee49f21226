"""The processes behind a real server a test started (vLLM's engine core, which the stall and
reload-failure tests stop and kill): shared by the engine-stall, reload-failure and LoRA tests."""

from __future__ import annotations

import psutil


def engine_core(proc) -> psutil.Process:
    """The server's engine-core process (vLLM names it VLLM::EngineCore)."""
    cores = [p for p in psutil.Process(proc.proc.pid).children(recursive=True) if "EngineCore" in p.name()]
    assert len(cores) == 1, [p.name() for p in psutil.Process(proc.proc.pid).children(recursive=True)]
    return cores[0]
