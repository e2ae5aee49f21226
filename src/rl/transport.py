"""Batch handover from orchestrator to trainer: the run directory or ZMQ, same payload.

  filesystem  batch n is the directory rollouts/step_n (rl/batch.py writes it atomically);
              works across hosts that share storage, and leaves batches to inspect
  zmq         PUSH (orchestrator, connects) -> PULL (trainer rank 0, binds) over tcp:// or ipc://;
              three frames: a tag, the meta JSON, the safetensors payload. No pickle: a peer
              can send garbage, never code.

Both receivers wait with a heartbeat log line and a timeout, never silently, and check every
batch (checksum, schema, step) before the trainer sees it. A damaged batch file is moved to
rollouts/rejected/ with the reason, and the orchestrator, which keeps every batch until the
trainer has published its version, writes it again; a damaged ZMQ message is dropped (whoever
sent it cannot be asked again).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from rl.batch import Batch, BatchError
from rl.config import TransportConfig
from rl.polling import Backoff
from rl.rundir import RunDir, write_file_atomic

log = logging.getLogger("transport")

TAG = b"asyncrl.batch"
HEARTBEAT_S = 30.0
LINK_TIMEOUT_S = 10.0  # no ZMTP heartbeat answer for this long: the connection to the trainer is dropped


class BatchSender:
    """Orchestrator side."""

    def __init__(self, cfg: TransportConfig, run: RunDir):
        self.cfg, self.run = cfg, run
        self.socket = None
        # Every batch handed over, until the trainer has published its version: a batch the
        # trainer rejected as damaged is written again (resend_rejected), and over ZMQ a
        # restarted trainer gets again what may have died in its predecessor's socket (resend).
        self.unconsumed: dict[int, tuple[bytes, bytes]] = {}
        if cfg.kind == "zmq":
            self.context = zmq.asyncio.Context()
            self.socket = self.context.socket(zmq.PUSH)
            # Queue only to a connected trainer: otherwise a batch "sent" before the trainer binds
            # sits in a local buffer and dies with this process. Send now blocks (visibly) until
            # the trainer is there; on close, queued batches get 5 s to leave.
            self.socket.setsockopt(zmq.IMMEDIATE, 1)
            self.socket.setsockopt(zmq.LINGER, 5000)
            # ZMTP heartbeats: a trainer whose host is cut off is noticed (connection dropped)
            # within LINK_TIMEOUT_S, not after TCP's own retransmission timeout (~15 min).
            self.socket.setsockopt(zmq.HEARTBEAT_IVL, 2000)
            self.socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(LINK_TIMEOUT_S * 1000))
            self.monitor = self.socket.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            self.socket.connect(cfg.address)

    async def send(self, batch: Batch, timeout_s: float) -> None:
        meta, payload = batch.encode()
        if self.socket is None:
            await asyncio.to_thread(Batch.write_encoded, meta, payload, self.run.rollout_dir(batch.step))
        else:
            await self._push(batch.step, meta, payload, timeout_s)
        # Only once out: a batch still being written is not missing (resend_rejected).
        self.unconsumed[batch.step] = (meta, payload)

    async def _push(self, step: int, meta: bytes, payload: bytes, timeout_s: float) -> None:
        send = asyncio.ensure_future(self.socket.send_multipart([TAG, meta, payload], copy=False))
        start = time.monotonic()
        # PUSH blocks while no trainer is connected: say so rather than hang silently.
        while not send.done():
            done, _ = await asyncio.wait([send], timeout=HEARTBEAT_S)
            if not done:
                waited = time.monotonic() - start
                if waited > timeout_s:
                    send.cancel()
                    raise TimeoutError(f"batch {step}: no trainer took it from {self.cfg.address} "
                                       f"in {timeout_s:.0f} s (transport.address)")
                log.info("batch %d: waiting for the trainer to connect to %s (%.0f s)",
                         step, self.cfg.address, waited)
        send.result()

    def forget(self, trained: int) -> None:
        """Version `trained` is published: batches up to it are trained for good."""
        for step in [n for n in self.unconsumed if n <= trained]:
            del self.unconsumed[step]

    async def resend(self, timeout_s: float) -> None:
        """ZMQ: send every untrained batch again, to a restarted or reconnected trainer (it drops
        those it kept on disk or already trained)."""
        for step, (meta, payload) in sorted(self.unconsumed.items()):
            log.warning("batch %d sent again to the trainer at %s", step, self.cfg.address)
            await self._push(step, meta, payload, timeout_s)

    async def watch_connection(self, timeout_s: float) -> None:
        """ZMQ, forever: say when the connection to the trainer drops (dead, or its host cut
        off), and once it is back send every untrained batch again: one in transit when the
        connection dropped went with it (the trainer drops the copies it does not need)."""
        lost = False
        while True:
            event = parse_monitor_message(await self.monitor.recv_multipart())["event"]
            if event == zmq.EVENT_DISCONNECTED and not lost:
                lost = True
                log.warning("lost the connection to the trainer at %s (dead, or its host cut off?); "
                            "batches wait for it", self.cfg.address)
            elif event == zmq.EVENT_CONNECTED and lost:
                lost = False
                log.info("connected to the trainer at %s again", self.cfg.address)
                await self.resend(timeout_s)

    async def resend_rejected(self) -> None:
        """Filesystem: write again each untrained batch whose directory is gone: the trainer
        moved it to rollouts/rejected/ as damaged."""
        for step, (meta, payload) in sorted(self.unconsumed.items()):
            final = self.run.rollout_dir(step)
            if not final.exists():
                # Trained and pruned since the caller's forget(): not missing.
                if step <= (self.run.latest_stable_weights() or 0):
                    self.forget(step)
                    continue
                log.warning("batch %d is gone from %s (rejected by the trainer? see %s): writing it again",
                            step, final, self.run.rollouts / "rejected")
                await asyncio.to_thread(Batch.write_encoded, meta, payload, final)

    def close(self) -> None:
        if self.socket is not None:
            self.socket.disable_monitor()
            self.monitor.close()
            self.socket.close()
            self.context.term()


@dataclass
class Received:
    batch: Batch
    meta: bytes
    payload: bytes
    """The blobs as received, checked: what the trainer's other ranks decode."""
    waited_s: float


class BatchReceiver:
    """Trainer side (rank 0 only under zmq; the trainer shares the bytes with its other ranks)."""

    def __init__(self, cfg: TransportConfig, run: RunDir, poll_s: float = 0.05, keep: bool = False,
                 reject_damaged: bool = True, on_wait: Callable[[], object] | None = None):
        """`keep` (zmq): write every batch received to rollouts/step_n and look there first, so a
        trainer resumed from an older checkpoint finds the batches it must train again (the
        orchestrator sent them long ago). `reject_damaged` (filesystem): move a damaged batch
        aside and wait for the orchestrator to write it again, rather than raise. `on_wait`:
        called about once a second while waiting (the trainer watches the orchestrator's
        heartbeat there)."""
        self.cfg, self.run, self.poll_s, self.keep = cfg, run, poll_s, keep
        self.backoff = Backoff(poll_s / 5, poll_s * 4)
        self.reject_damaged, self.on_wait = reject_damaged, on_wait
        self.socket = None
        self.early: dict[int, tuple[bytes, bytes]] = {}
        if cfg.kind == "zmq":
            self.context = zmq.Context()
            self.socket = self.context.socket(zmq.PULL)
            self.socket.bind(cfg.bind or cfg.address)

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
                                   "(trainer.batch_timeout_s); is the orchestrator running?")
            if now - last_beat > HEARTBEAT_S:
                log.info("waiting for batch %d for %.0f s", step, now - start)
                last_beat = now
            if self.on_wait is not None and now - last_watch > 1.0:
                self.on_wait()
                last_watch = now

    def _poll(self, step: int) -> tuple[bytes, bytes, Batch] | None:
        if self.socket is None:
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
        if step in self.early:
            return self.early.pop(step)
        if self.keep and self.run.rollout_dir(step).exists():
            return self._read(step, self.run.rollout_dir(step))
        if not self.socket.poll(timeout=int(self.poll_s * 1000)):
            return None
        frames = self.socket.recv_multipart()
        try:
            if len(frames) != 3 or frames[0] != TAG:
                raise BatchError(f"{self.cfg.address}: a message that is not an asyncrl batch "
                                 f"({len(frames)} frames)")
            meta, payload = frames[1], frames[2]
            batch = Batch.decode(meta, payload, self.cfg.address)
        except BatchError as e:  # anyone who can reach the socket can send this: not fatal
            log.error("dropped a message: %s", e)
            return None
        got = batch.step
        if self.keep and got >= step:
            Batch.write_encoded(meta, payload, self.run.rollout_dir(got))
        if got == step:
            return meta, payload, batch
        if got < step:
            log.warning("dropped batch %d from %s: already trained past it", got, self.cfg.address)
        else:
            self.early[got] = (meta, payload, batch)
        return None

    @staticmethod
    def _read(step: int, path: Path) -> tuple[bytes, bytes, Batch]:
        batch, meta, payload = Batch.read_checked(path)
        if batch.step != step:
            raise BatchError(f"{path / 'meta.json'}: holds batch {batch.step}, expected {step}")
        return meta, payload, batch

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
        """Where batch `step` comes from, for error messages."""
        return self.cfg.address if self.socket is not None else str(self.run.rollout_dir(step) / "batch.safetensors")

    def close(self) -> None:
        if self.socket is not None:
            self.socket.close(linger=0)
            self.context.term()

