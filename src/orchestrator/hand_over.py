"""Handing a batch to the trainer: the samples of its groups encoded once, checkpointed with what
is still pending, then sent by the run's transport (rl/transport/registry.py). The checkpoint comes first
so that every prompt lands in exactly one trained batch whenever the orchestrator dies
(checkpoint.py says how a resume decides whether to send it again)."""

from __future__ import annotations

from orchestrator.checkpoint import ResumePoint, checkpointed_batch, resume_point, save_checkpoint
from orchestrator.prompts import Prompt
from orchestrator.rollout import Group
from rl.batch import Batch
from rl.config import RunConfig
from rl.faults import crash_point
from rl.heartbeat import set_phase
from rl.rundir import RunDir
from rl.transport.registry import batch_sender


class HandOver:
    def __init__(self, cfg: RunConfig, run_dir: RunDir):
        self.run_dir, self.settings, self.keep = run_dir, cfg.orchestrator, cfg.checkpoints.keep
        self.sender = batch_sender(cfg.transport, run_dir)

    def resume(self) -> ResumePoint:
        """Where the last checkpoint left off (a fresh start without one)."""
        return resume_point(self.run_dir, self.sender)

    async def send(self, step: int, groups: list[Group], cursor: int, pending: list[Prompt],
                   curriculum: dict | None) -> Batch:
        """Batch `step` of `groups`, checkpointed with the data cursor, the `pending` prompts and the
        curriculum's record, then handed over."""
        batch = Batch.from_samples(step, [s for g in groups for s in g.samples])
        encoded = batch.encode()  # once: the checkpoint and the hand-over take the same bytes
        save_checkpoint(self.run_dir, step, encoded, cursor, pending, self.keep, curriculum)
        crash_point("orchestrator.checkpointed", step)
        set_phase(f"handing over batch {step}")
        await self.sender.send(batch, self.settings.timeouts.weights_s, encoded)
        crash_point("orchestrator.handed_over", step)
        return batch

    async def send_again(self, batch: Batch) -> None:
        """A checkpointed batch that may never have reached the trainer: the same bytes again."""
        await self.sender.send(batch, self.settings.timeouts.weights_s)

    def checkpointed(self, step: int) -> Batch:
        """Batch `step` as its checkpoint holds it (the bytes handed over)."""
        return checkpointed_batch(self.run_dir, step)

    async def redeliver(self) -> None:
        """Background: hand the trainer again what it lost (a restarted ZMQ trainer)."""
        await self.sender.redeliver(self.settings.timeouts.weights_s)

    def close(self) -> None:
        self.sender.close()
