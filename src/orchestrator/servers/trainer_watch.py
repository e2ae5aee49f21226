"""The orchestrator's watch on the trainer, a background loop: says within seconds when the
trainer (or one of its ranks) dies or freezes, lets the batch sender forget what the trainer has
trained, and stops the run when a multi-run trainer turned it away."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

from rl.config import RunConfig
from rl.heartbeat import PeerReporter, PeerWatch, current_instance, heartbeat_path
from rl.rundir import RunDir
from rl.transport.interface import BatchSender

log = logging.getLogger("orchestrator")


async def watch_trainer(cfg: RunConfig, run_dir: RunDir, sender: BatchSender, next_step: Callable[[], int]) -> None:
    """Say within seconds when the trainer dies or freezes (batches then wait for it: a
    trainer restarted with --resume continues), let the sender forget the batches it has
    trained, and stop if a multi-run trainer turned this run away. `next_step()`: the batch
    the orchestrator hands over next."""
    watch = PeerWatch(heartbeat_path(cfg, "trainer"), "trainer", cfg.timeouts.heartbeat_s)
    trainer = PeerReporter(watch, log, "batches wait for it (restart it with --resume)")
    ranks: dict[str, PeerReporter] = {}  # the trainer's other ranks, on other nodes maybe
    while True:
        if next_step() <= cfg.max_steps:  # after the last batch, a trainer that exits is done
            trainer.poll()
            for path in RunDir(cfg.output_dir).heartbeat_dir.glob("trainer-rank*"):
                if path.name not in ranks:
                    ranks[path.name] = PeerReporter(
                        PeerWatch(path, path.name, cfg.timeouts.heartbeat_s), log,
                        "the trainer's collectives wait for it (torchrun stops the trainer if it is gone)")
            for reporter in ranks.values():
                reporter.poll()
        # sender.redeliver hands the trainer again only the batches it has not trained.
        sender.forget(run_dir.latest_stable_weights() or 0)
        check_trainer(cfg, run_dir)
        await asyncio.sleep(1.0)


def check_trainer(cfg: RunConfig, run_dir: RunDir) -> None:
    """Multi-run: a trainer that turned this run away says why in trainer_status.json."""
    if not cfg.run_name:
        return
    try:
        status = json.loads(run_dir.trainer_status.read_text())
    except (OSError, ValueError):
        return
    if status.get("status") in ("rejected", "failed") and status.get("orchestrator") == current_instance():
        raise RuntimeError(f"the trainer {status['status']} run {cfg.run_name}: {status.get('detail')}")
