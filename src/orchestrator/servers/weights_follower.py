"""Following the trainer's weights: each new STABLE version in the run directory is loaded into
every server in rotation by the run's delivery (delivery.py), and the scheduling loop is woken
when it serves. A background loop of the orchestrator (`follow`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from pathlib import Path

from orchestrator.bounded_wait import notified
from orchestrator.servers.delivery import WeightDelivery
from orchestrator.servers.pool import ServerPool
from orchestrator.servers.server import Server
from rl.polling import Backoff
from rl.rundir import RunDir


class WeightsFollower:
    def __init__(self, run_dir: RunDir, base_model: Path, pool: ServerPool, delivery: WeightDelivery,
                 poll_interval_s: float, changed: asyncio.Condition, handed_over: Callable[[], int],
                 in_use: Callable[[], Iterable[tuple[Server, int]]], hold: asyncio.Event):
        """`handed_over()`: the last batch handed to the trainer; `in_use()`: the (server, version)
        pairs groups and evaluations in flight started on; `hold`: version 0 serves until it is set
        (the baseline evaluation, bounded by orchestrator.timeouts.eval_s)."""
        self.run_dir, self.base_model, self.pool, self.delivery = run_dir, base_model, pool, delivery
        self.changed, self.handed_over, self.in_use, self.hold = changed, handed_over, in_use, hold
        self.poll_interval_s = poll_interval_s
        self.poll = Backoff(poll_interval_s, 5 * poll_interval_s)

    def latest(self) -> tuple[int, Path]:
        """The newest stable version and where it is (0: the base model)."""
        latest = self.run_dir.latest_stable_weights()
        return (0, self.base_model) if latest is None else (latest, self.run_dir.weights_dir(latest))

    async def follow(self) -> None:
        while True:
            version, path = self.latest()
            if version > 0 and not self.hold.is_set():
                await self.hold.wait()
                continue
            if version > self.pool.version or any(s.version != version for s in self.pool.in_rotation):
                await self.delivery.load(version, path)
                self.poll.reset()
                async with self.changed:
                    self.changed.notify_all()
            # LoRA: what each group and evaluation in flight started on stays loaded (read only
            # by AdapterDelivery, hence lazily).
            await self.delivery.unload_unused(self.in_use())
            await self.until_due()

    def due(self) -> bool:
        """A batch was handed over whose weights are not served yet."""
        return self.handed_over() > self.pool.version

    async def until_due(self) -> None:
        """Pause between looks at the run directory. A version's discovery is part of every
        weight update's latency (a tiny model reloads in ~35 ms; docs/performance.md), so while
        one is due: poll_interval_s, backing off to five times that while it does not come.
        Otherwise up to ten times that, woken by the hand-over of a batch: fast polling then
        would only cost file-system calls (round trips on NFS)."""
        if self.due():
            await asyncio.sleep(self.poll.next())
            return
        async with self.changed:
            await notified(self.changed, 10 * self.poll_interval_s, self.due)
