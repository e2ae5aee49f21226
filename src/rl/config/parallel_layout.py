"""The trainer's [trainer.parallel] layout against its rank count: asked by the trainer (its mesh,
trainer/parallel.py, and its start-up check) and by `rl run` (how many ranks to start, checked
before any engine starts)."""

from __future__ import annotations

from rl.config.load import ConfigError
from rl.config.trainer import ParallelConfig


def mesh_sizes(parallel: ParallelConfig, world: int) -> tuple[int, int, int]:
    """(data, context, expert) for `world` ranks; data = 0 takes what context x expert leave.
    A layout that does not multiply to the world size is refused with one line naming the keys."""
    inner = parallel.context * parallel.expert
    data = parallel.data or max(1, world // inner)
    if data * inner != world:
        raise ConfigError(f"trainer.parallel: data x context x expert = {data} x {parallel.context} x "
                          f"{parallel.expert} = {data * inner}, but the trainer has {world} rank(s); set "
                          f"trainer.parallel.data/context/expert so that they multiply to {world}")
    return data, parallel.context, parallel.expert


def cpu_world(parallel: ParallelConfig) -> int:
    """How many ranks `rl run` starts without GPUs: the configured product (data = 0 counting as 1)."""
    return (parallel.data or 1) * parallel.context * parallel.expert
