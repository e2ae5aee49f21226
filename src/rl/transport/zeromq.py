"""Batches over ZMQ: PUSH (orchestrator, connects) -> PULL (trainer rank 0, binds).

Over tcp:// or ipc://, three frames: a tag, the meta JSON, the safetensors payload. No pickle:
anyone who can reach the socket can send garbage, never code, and the receiver drops a message
that is not an intact batch, logging it (whoever sent it cannot be asked again).

A batch counts as sent once queued in this process, and may die there or in transit with the
connection, so the orchestrator keeps every batch until the trainer has published its version
and sends them all again when the connection to the trainer comes back (a restarted trainer,
or its host's link): the trainer drops the copies it does not need. With `keep`, the trainer
writes every batch received to rollouts/step_n too, so a trainer resumed from an older
checkpoint finds the ones it must train again.
"""

from __future__ import annotations

import asyncio
import logging
import time

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from rl.batch import Batch, BatchError
from rl.config import TransportConfig
from rl.transport.interface import HEARTBEAT_S, BatchReceiver, BatchSender

log = logging.getLogger("transport")

TAG = b"asyncrl.batch"
LINK_TIMEOUT_S = 10.0  # no ZMTP heartbeat answer for this long: the connection to the trainer is dropped


class ZmqSender(BatchSender):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
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
        self.socket.connect(self.cfg.address)

    async def _hand_over(self, step: int, meta: bytes, payload: bytes, timeout_s: float) -> None:
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

    def discard_partial(self) -> None:
        pass  # a message is whole or not sent: nothing is left half handed over

    async def redeliver(self, timeout_s: float) -> None:
        await self.watch_connection(timeout_s)

    async def resend(self, timeout_s: float) -> None:
        """Send every untrained batch again, to a restarted or reconnected trainer (it drops
        those it kept on disk or already trained)."""
        for step, (meta, payload) in sorted(self.unconsumed.items()):
            log.warning("batch %d sent again to the trainer at %s", step, self.cfg.address)
            await self._hand_over(step, meta, payload, timeout_s)

    async def watch_connection(self, timeout_s: float) -> None:
        """Forever: say when the connection to the trainer drops (dead, or its host cut off),
        and once it is back send every untrained batch again: one in transit when the
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

    def close(self) -> None:
        self.socket.disable_monitor()
        self.monitor.close()
        self.socket.close()
        self.context.term()


class ZmqReceiver(BatchReceiver):
    @staticmethod
    def endpoint(cfg: TransportConfig) -> tuple[str, str] | None:
        return ("transport.bind", cfg.bind) if cfg.bind else ("transport.address", cfg.address)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.early: dict[int, tuple[bytes, bytes, Batch]] = {}  # arrived before they were asked for
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.PULL)
        self.socket.bind(self.cfg.bind or self.cfg.address)

    def _poll(self, step: int) -> tuple[bytes, bytes, Batch] | None:
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

    def source(self, step: int) -> str:
        return self.cfg.address

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()
