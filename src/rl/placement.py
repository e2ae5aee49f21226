"""Core placement: pin a program, and every process and thread it starts, to the cores its config
section names (`[inference] cpus`, `[orchestrator] cpus`, `[trainer] cpus`).

Why: on a machine the three programs share, the kernel spreads them over every core. vLLM's CPU
engine with a worker process of its own (inference.one_process_engine = false) keeps a scheduler
process polling on another core, and that core is the trainer's on a small machine: measured on
the 2-core build machine, the scheduler took ~30% of the trainer's core and the trainer step
slowed by ~40% (docs/performance.md). In one process the engine computes on every core it may.
Pinning happens first thing in the program, before any thread or child exists, so all inherit it.
"""

from __future__ import annotations

import os


from rl.config import ConfigError


class PlacementError(ConfigError):
    pass


def check(key: str, cpus: list[int]) -> None:
    """Every core in `cpus` is one this process may use; `key` names the config setting."""
    available = os.sched_getaffinity(0)
    missing = sorted(set(cpus) - available)
    if missing:
        raise PlacementError(f"{key} = {cpus}: core(s) {missing} are not available to this process "
                             f"(it may use {sorted(available)})")


def pin(key: str, cpus: list[int]) -> None:
    """Restrict this process (and so its future threads and children) to `cpus`; [] leaves it be."""
    if not cpus:
        return
    check(key, cpus)
    os.sched_setaffinity(0, set(cpus))
    # vLLM's CPU worker binds its OpenMP threads itself ("auto": the last cores of the node, not
    # ours); tell it to use exactly ours unless the user chose otherwise.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, sorted(set(cpus)))))
