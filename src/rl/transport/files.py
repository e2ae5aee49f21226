"""Batches through the run directory: batch n is rollouts/step_n.

The orchestrator writes it atomically (rl/batch.py: written as .step_n, then renamed), so the
trainer, polling with backoff, sees a batch whole or not at all; it works across hosts that
share storage and leaves every batch there to inspect. A batch that arrives damaged anyway
(storage, a partial copy) is moved by the trainer to rollouts/rejected/step_n.i with a REJECTED
file giving the reason; the orchestrator, which keeps every batch until the trainer has
published its version, notices the directory is gone and writes it again.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

from rl.batch import Batch, BatchError
from rl.polling import Backoff
from rl.rundir import remove_quietly, write_file_atomic
from rl.transport.interface import BatchReceiver, BatchSender

log = logging.getLogger("transport")

REJECTED_CHECK_S = 1.0  # how often the orchestrator looks for batches the trainer rejected


class FileSender(BatchSender):
    async def _hand_over(self, step: int, meta: bytes, payload: bytes, timeout_s: float) -> None:
        await asyncio.to_thread(Batch.write_encoded, meta, payload, self.run.rollout_dir(step))

    def discard_partial(self) -> None:
        # A batch this orchestrator's predecessor was writing when it died: never published,
        # its groups are still pending in the checkpoint and go out again.
        for partial in self.run.rollouts.glob(".step_*"):
            remove_quietly(partial)

    async def redeliver(self, timeout_s: float) -> None:
        while True:
            await self.resend_rejected()
            await asyncio.sleep(REJECTED_CHECK_S)

    async def resend_rejected(self) -> None:
        """Write again each untrained batch whose directory is gone: the trainer moved it to
        rollouts/rejected/ as damaged."""
        for step, (meta, payload) in sorted(self.unconsumed.items()):
            final = self.run.rollout_dir(step)
            if not final.exists():
                # Trained and pruned since the last forget(): not missing.
                if step <= (self.run.latest_stable_weights() or 0):
                    self.forget(step)
                    continue
                log.warning("batch %d is gone from %s (rejected by the trainer? see %s): writing it again",
                            step, final, self.run.rollouts / "rejected")
                await asyncio.to_thread(Batch.write_encoded, meta, payload, final)

    def close(self) -> None:
        pass  # nothing held open


class FileReceiver(BatchReceiver):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.backoff = Backoff(self.poll_s / 5, self.poll_s * 4)

    def _poll(self, step: int) -> tuple[bytes, bytes, Batch] | None:
        path = self.run.rollout_dir(step)
        if not path.exists():  # it appears whole, by rename
            time.sleep(self.backoff.next())
            return None
        self.backoff.reset()
        try:
            return self._read(step, path)
        except BatchError as e:
            if not self.reject_damaged:
                raise
            self._reject(step, e)
            return None

    def _reject(self, step: int, error: BatchError) -> None:
        """Move a damaged batch out of the way, with the reason, for the orchestrator to replace
        (and for a person to inspect)."""
        rejected = self.run.rollouts / "rejected"
        rejected.mkdir(exist_ok=True)
        dest = next(rejected / f"step_{step}.{i}" for i in itertools.count(1)
                    if not (rejected / f"step_{step}.{i}").exists())
        self.run.rollout_dir(step).rename(dest)
        write_file_atomic(dest / "REJECTED", f"{error}\n".encode())
        log.error("batch %d rejected: %s; moved to %s, waiting for the orchestrator to write it again",
                  step, error, dest)

    def source(self, step: int) -> str:
        return str(self.run.rollout_dir(step) / "batch.safetensors")

    def close(self) -> None:
        pass  # nothing held open
