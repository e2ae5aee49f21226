"""Batch handover from orchestrator to trainer: the run directory or ZMQ, same payload.

  filesystem  batch n is the directory rollouts/step_n (rl/batch.py writes it atomically);
              works across hosts that share storage, and leaves batches to inspect
  zmq         PUSH (orchestrator, connects) -> PULL (trainer rank 0, binds) over tcp:// or ipc://;
              three frames: a tag, the meta JSON, the safetensors payload. No pickle: a peer
              can send garbage, never code.

Both receivers wait with a heartbeat log line and a timeout, never silently.
"""

from __future__ import annotations

import asyncio
import logging
import time

import zmq
import zmq.asyncio

from rl.batch import Batch, BatchError
from rl.config import TransportConfig
from rl.rundir import RunDir

log = logging.getLogger("transport")

TAG = b"asyncrl.batch"
HEARTBEAT_S = 30.0


class BatchSender:
    """Orchestrator side."""

    def __init__(self, cfg: TransportConfig, run: RunDir):
        self.cfg, self.run = cfg, run
        self.socket = None
        if cfg.kind == "zmq":
            self.context = zmq.asyncio.Context()
            self.socket = self.context.socket(zmq.PUSH)
            # Queue only to a connected trainer: otherwise a batch "sent" before the trainer binds
            # sits in a local buffer and dies with this process. Send now blocks (visibly) until
            # the trainer is there; on close, queued batches get 5 s to leave.
            self.socket.setsockopt(zmq.IMMEDIATE, 1)
            self.socket.setsockopt(zmq.LINGER, 5000)
            self.socket.connect(cfg.address)

    async def send(self, batch: Batch, timeout_s: float) -> None:
        if self.socket is None:
            await asyncio.to_thread(batch.write, self.run.rollout_dir(batch.step))
            return
        meta, payload = batch.encode()
        send = asyncio.ensure_future(self.socket.send_multipart([TAG, meta, payload], copy=False))
        start = time.monotonic()
        # PUSH blocks while no trainer is connected: say so rather than hang silently.
        while not send.done():
            done, _ = await asyncio.wait([send], timeout=HEARTBEAT_S)
            if not done:
                waited = time.monotonic() - start
                if waited > timeout_s:
                    send.cancel()
                    raise TimeoutError(f"batch {batch.step}: no trainer took it from {self.cfg.address} "
                                       f"in {timeout_s:.0f} s (transport.address)")
                log.info("batch %d: waiting for the trainer to connect to %s (%.0f s)",
                         batch.step, self.cfg.address, waited)
        send.result()

    def close(self) -> None:
        if self.socket is not None:
            self.socket.close()
            self.context.term()


class BatchReceiver:
    """Trainer side (rank 0 only under zmq; the trainer shares the bytes with its other ranks)."""

    def __init__(self, cfg: TransportConfig, run: RunDir, poll_s: float = 0.05, keep: bool = False):
        """`keep` (zmq): write every batch received to rollouts/step_n and look there first, so a
        trainer resumed from an older checkpoint finds the batches it must train again (the
        orchestrator sent them long ago)."""
        self.cfg, self.run, self.poll_s, self.keep = cfg, run, poll_s, keep
        self.socket = None
        self.early: dict[int, tuple[bytes, bytes]] = {}
        if cfg.kind == "zmq":
            self.context = zmq.Context()
            self.socket = self.context.socket(zmq.PULL)
            self.socket.bind(cfg.address)

    def receive(self, step: int, timeout_s: float) -> tuple[tuple[bytes, bytes], float]:
        """The encoded batch `step` (meta, payload) and the seconds waited for it."""
        start = last_beat = time.monotonic()
        while True:
            got = self._poll(step)
            if got is not None:
                return got, time.monotonic() - start
            now = time.monotonic()
            if now - start > timeout_s:
                raise TimeoutError(f"no batch {step} at {self.source(step)} after {timeout_s:.0f} s "
                                   "(trainer.batch_timeout_s); is the orchestrator running?")
            if now - last_beat > HEARTBEAT_S:
                log.info("waiting for batch %d for %.0f s", step, now - start)
                last_beat = now

    def _poll(self, step: int) -> tuple[bytes, bytes] | None:
        if self.socket is None:
            path = self.run.rollout_dir(step)
            if not path.exists():  # it appears whole, by rename
                time.sleep(self.poll_s)
                return None
            return Batch.read_encoded(path)
        if step in self.early:
            return self.early.pop(step)
        if self.keep and self.run.rollout_dir(step).exists():
            return Batch.read_encoded(self.run.rollout_dir(step))
        if not self.socket.poll(timeout=int(self.poll_s * 1000)):
            return None
        frames = self.socket.recv_multipart()
        if len(frames) != 3 or frames[0] != TAG:
            raise BatchError(f"{self.cfg.address}: a message that is not an asyncrl batch "
                             f"({len(frames)} frames)")
        meta, payload = frames[1], frames[2]
        got = Batch.decode(meta, payload, self.cfg.address).step
        if self.keep and got >= step:
            Batch.write_encoded(meta, payload, self.run.rollout_dir(got))
        if got == step:
            return meta, payload
        if got < step:
            log.warning("dropped batch %d from %s: already trained past it", got, self.cfg.address)
        else:
            self.early[got] = (meta, payload)
        return None

    def source(self, step: int) -> str:
        """Where batch `step` comes from, for error messages."""
        return self.cfg.address if self.socket is not None else str(self.run.rollout_dir(step) / "batch.safetensors")

    def close(self) -> None:
        if self.socket is not None:
            self.socket.close(linger=0)
            self.context.term()

