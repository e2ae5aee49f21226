"""Which batch transport a run uses: the one place that reads transport.kind. A new kind is a
module implementing rl/transport/interface.py's BatchSender and BatchReceiver, and a line in KINDS."""

from __future__ import annotations

from rl.config import TransportConfig
from rl.rundir import RunDir
from rl.transport.interface import BatchReceiver, BatchSender
from rl.transport.files import FileReceiver, FileSender
from rl.transport.zeromq import ZmqReceiver, ZmqSender

KINDS: dict[str, tuple[type[BatchSender], type[BatchReceiver]]] = {
    "files": (FileSender, FileReceiver),
    "zmq": (ZmqSender, ZmqReceiver),
}


def batch_sender(cfg: TransportConfig, run: RunDir) -> BatchSender:
    """The orchestrator's side of `cfg.kind`."""
    return KINDS[cfg.kind][0](cfg, run)


def receiver_endpoint(cfg: TransportConfig) -> tuple[str, str] | None:
    """(config key, endpoint) where `cfg.kind`'s trainer side binds; None where it binds nothing."""
    return KINDS[cfg.kind][1].endpoint(cfg)


def batch_receiver(cfg: TransportConfig, run: RunDir, **options) -> BatchReceiver:
    """The trainer's side of `cfg.kind` (options: BatchReceiver's)."""
    return KINDS[cfg.kind][1](cfg, run, **options)
