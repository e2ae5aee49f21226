"""One inference server as the orchestrator sees it: its client, the version it serves, its load,
its place in rotation. The pool (orchestrator/servers/pool.py) owns every field: the weight delivery
(orchestrator/servers/delivery.py) reports what it did and the pool records it."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from rl.inference_api import InferenceClient


@dataclass
class Server:
    client: InferenceClient
    version: int = 0
    in_flight: int = 0
    """Requests now generating (for idle accounting)."""
    groups: int = 0
    """Groups assigned and not yet finished (for routing: counted from the moment of assignment,
    so a burst of new groups spreads over the servers)."""
    healthy: bool = False
    updating: bool = False
    update: asyncio.Task | None = None
    """Its weight update in progress (file sync): cancelled when it leaves rotation, so that a
    server cut off mid-update does not hold the other servers' next version back."""
    backoff_s: float = 1.0
    retry_at: float = 0.0
    idle_s: float = 0.0
    idle_since: float | None = field(default_factory=time.monotonic)
    listed: bool = True
    """In orchestrator.servers.urls: never forgotten, only taken out of rotation."""
    joined: bool = False
    """Has served in this run (before that it is joining: probed every second, noted every
    30 s)."""
    noted_at: float = field(default_factory=time.monotonic)
    silent: bool = False
    """Its heartbeat stopped: kept out of rotation even if it answers HTTP (it cannot read
    the run directory, so it cannot load new weights)."""
    last_error: str = ""
    """Why it last left rotation or failed to rejoin (named if none is left for long)."""

    @property
    def url(self) -> str:
        return self.client.url
