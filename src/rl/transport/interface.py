"""Batch handover from orchestrator to trainer: the run directory or ZMQ, same payload.

  filesystem  batch n is the directory rollouts/step_n (rl/batch.py writes it atomically);
              works across hosts that share storage, and leaves batches to inspect
              (rl/transport/files.py)
  zmq         PUSH (orchestrator, connects) -> PULL (trainer rank 0, binds) over tcp:// or ipc://;
              three frames: a tag, the meta JSON, the safetensors payload. No pickle: a peer
              can send garbage, never code (rl/transport/zeromq.py)

One interface for both: a BatchSender (orchestrator side) and a BatchReceiver (trainer side).
The kind is looked at once, in rl/transport/registry.py (`batch_sender(cfg, run)`, `batch_receiver(cfg,
run, ...)`: one registry line per kind), and whatever differs between the kinds (what is left
half handed over after a crash, how a batch the trainer lost reaches it again) is a method of
the implementation.

Both receivers wait with a heartbeat log line and a timeout, never silently, and check every
batch (checksum, schema, step) before the trainer sees it. A damaged batch file is moved to
rollouts/rejected/ with the reason, and the orchestrator, which keeps every batch until the
trainer has published its version, writes it again; a damaged ZMQ message is dropped (whoever
sent it cannot be asked again).
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from rl.batch import Batch, BatchError
from rl.config import TransportConfig
from rl.rundir import RunDir

log = logging.getLogger("transport")

HEARTBEAT_S = 30.0


class BatchSender(ABC):
    """Orchestrator side: FileSender or ZmqSender (rl/transport/registry.py batch_sender)."""

    def __init__(self, cfg: TransportConfig, run: RunDir):
        self.cfg, self.run = cfg, run
        # Every batch handed over, until the trainer has published its version: a batch the
        # trainer rejected as damaged is written again (resend_rejected), and over ZMQ a
        # restarted trainer gets again what may have died in its predecessor's socket (resend).
        self.unconsumed: dict[int, tuple[bytes, bytes]] = {}

    async def send(self, batch: Batch, timeout_s: float, encoded: tuple[bytes, bytes] | None = None) -> None:
        """Hand `batch` over; `encoded`: its batch.encode(), when the caller has it already."""
        meta, payload = encoded or batch.encode()
        await self._hand_over(batch.step, meta, payload, timeout_s)
        # Only once out: a batch still being written is not missing (resend_rejected).
        self.unconsumed[batch.step] = (meta, payload)

    @abstractmethod
    async def _hand_over(self, step: int, meta: bytes, payload: bytes, timeout_s: float) -> None:
        """Put batch `step` where the trainer takes it from."""

    def forget(self, trained: int) -> None:
        """Version `trained` is published: batches up to it are trained for good."""
        for step in [n for n in self.unconsumed if n <= trained]:
            del self.unconsumed[step]

    @abstractmethod
    def discard_partial(self) -> None:
        """On start: remove what a predecessor that died mid-handover left half handed over."""

    @abstractmethod
    async def redeliver(self, timeout_s: float) -> None:
        """Forever, in the background: hand every untrained batch the trainer lost to it again."""

    @abstractmethod
    def close(self) -> None:
        ...


@dataclass
class Received:
    batch: Batch
    meta: bytes
    payload: bytes
    """The blobs as received, checked: what the trainer's other ranks decode."""
    waited_s: float


class BatchReceiver(ABC):
    """Trainer side (rank 0 only under zmq; the trainer shares the bytes with its other ranks):
    FileReceiver or ZmqReceiver (rl/transport/registry.py batch_receiver)."""

    def __init__(self, cfg: TransportConfig, run: RunDir, poll_s: float = 0.05, keep: bool = False,
                 reject_damaged: bool = True, on_wait: Callable[[], object] | None = None):
        """`keep` (zmq): write every batch received to rollouts/step_n and look there first, so a
        trainer resumed from an older checkpoint finds the batches it must train again (the
        orchestrator sent them long ago). `reject_damaged` (filesystem): move a damaged batch
        aside and wait for the orchestrator to write it again, rather than raise. `on_wait`:
        called about once a second while waiting (the trainer watches the orchestrator's
        heartbeat there)."""
        self.cfg, self.run, self.poll_s, self.keep = cfg, run, poll_s, keep
        self.reject_damaged, self.on_wait = reject_damaged, on_wait

    @staticmethod
    def endpoint(cfg: TransportConfig) -> tuple[str, str] | None:
        """(config key, endpoint) where this kind's trainer side binds, for the start-up checks and
        the job planner to check; None: it binds nothing (the run directory carries the batches)."""
        return None

    def receive(self, step: int, timeout_s: float) -> Received:
        """Batch `step`, checked, and the seconds waited for it."""
        start = last_beat = last_watch = time.monotonic()
        while True:
            got = self._poll(step)
            if got is not None:
                meta, payload, batch = got
                return Received(batch, meta, payload, time.monotonic() - start)
            now = time.monotonic()
            if now - start > timeout_s:
                raise TimeoutError(f"no batch {step} at {self.source(step)} after {timeout_s:.0f} s "
                                   "(trainer.timeouts.batch_s); is the orchestrator running?")
            if now - last_beat > HEARTBEAT_S:
                log.info("waiting for batch %d for %.0f s", step, now - start)
                last_beat = now
            if self.on_wait is not None and now - last_watch > 1.0:
                self.on_wait()
                last_watch = now

    @abstractmethod
    def _poll(self, step: int) -> tuple[bytes, bytes, Batch] | None:
        """Batch `step` if it is there, checked; None after waiting a little for it."""

    @staticmethod
    def _read(step: int, path: Path) -> tuple[bytes, bytes, Batch]:
        batch, meta, payload = Batch.read_checked(path)
        if batch.step != step:
            raise BatchError(f"{path / 'meta.json'}: holds batch {batch.step}, expected {step}")
        return meta, payload, batch

    @abstractmethod
    def source(self, step: int) -> str:
        """Where batch `step` comes from, for error messages."""

    @abstractmethod
    def close(self) -> None:
        ...
