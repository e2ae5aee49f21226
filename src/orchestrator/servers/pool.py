"""The inference servers as the orchestrator sees them: which version each serves, how many
requests each has in flight, which are in rotation.

Servers join and leave while the run goes on. A listed server (orchestrator.servers.urls) or
one that announces itself in the run directory (discover) joins once it answers /health, loaded
with the pool's current version first. A server that fails a request or a health check is taken
out of rotation at once (one that no longer answers at all: on_fail requeues its groups in
flight) and health-checked with exponential
backoff; it rejoins only after it serves the pool's current version, so the async rule (every
server in rotation serves >= n-1-k) never regresses. A discovered server whose heartbeat stops
(removed, or silent for timeouts.heartbeat_s) leaves the pool; it joins again when it comes back.

How a version reaches a server (files, broadcast, LoRA adapters) and what its /health means is
the run's weight delivery (orchestrator/servers/delivery.py); the pool decides who is in rotation and
records every server's state (orchestrator/servers/server.py), the delivery reporting what it did.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp

from orchestrator.servers.delivery import WeightDelivery, weight_delivery
from orchestrator.servers.identity import Identity
from orchestrator.servers.server import Server
from orchestrator.streaks import Spinning
from rl.heartbeat import SERVING, PeerWatch, announced_url, server_heartbeats
from rl.inference_api import InferenceClient, InferenceError

if TYPE_CHECKING:
    from rl.config import RunConfig

log = logging.getLogger("orchestrator")

# How often the run directory's heartbeats are read: a server that stops is out of rotation
# within this (plus its in-flight requests), one that starts joins within this plus its load.
DISCOVER_EVERY_S = 1.0


class ServerPool:
    @classmethod
    def for_run(cls, cfg: RunConfig, session: aiohttp.ClientSession,
                on_fail: Callable[[Server], None] | None = None) -> ServerPool:
        """The run's servers, with the weight delivery of its weight_sync kind."""
        own = None if cfg.orchestrator.servers.urls else cfg.inference.url
        return cls(cfg.urls, session, cfg.inference.api_token, cfg.orchestrator.servers.retry_max_s,
                   lambda pool: weight_delivery(cfg, pool), on_fail=on_fail, identity=Identity(cfg.output_dir, own))

    def __init__(self, urls: list[str], session: aiohttp.ClientSession, token: str | None, retry_max_s: float,
                 delivery: Callable[[ServerPool], WeightDelivery],
                 on_fail: Callable[[Server], None] | None = None, identity: Identity | None = None):
        """`delivery(pool)`: makes the run's weight delivery (orchestrator/servers/delivery.py), which
        brings a server to the current version before it (re)joins rotation.
        `on_fail(server)`: called when a server leaves rotation, to requeue its groups.
        `identity`: checks that the program answering at a URL is the run's (none: any that answers)."""
        self.session, self.token = session, token
        self.servers = [Server(InferenceClient(u.rstrip("/"), session, token)) for u in urls]
        self.on_fail = on_fail
        self.retry_max_s = retry_max_s
        self.delivery = delivery(self)
        self.identity = identity

    @property
    def version(self) -> int:
        """What every server in rotation must serve: the version last delivered."""
        return self.delivery.target.version

    # --- what the delivery reports ---------------------------------------------------------

    def serving(self, s: Server, version: int) -> None:
        """The delivery brought `s` to `version` (or its /health says it serves it)."""
        s.version = version

    def updating(self, s: Server, update: asyncio.Task | None) -> None:
        """`s` is being brought to a new version: not routed to meanwhile; `update`, if given,
        is cancelled should it leave rotation."""
        s.updating, s.update = True, update

    def updated(self, s: Server) -> None:
        s.updating, s.update = False, None

    def impostor(self, s: Server, health: dict) -> str | None:
        """Why the program answering at s.url is not the run's server (identity.py); None: it is."""
        return self.identity.problem(s.url, health) if self.identity is not None else None

    def note(self, s: Server, health: dict) -> None:
        """Record what a server (joining, or answering again) serves, as its delivery reads it."""
        self.serving(s, self.delivery.reported_version(health))
        self.delivery.seen(s, health)

    # --- rotation and load ---------------------------------------------------------------

    @property
    def in_rotation(self) -> list[Server]:
        return [s for s in self.servers if s.healthy]

    def serving_versions(self) -> list[int]:
        return [s.version for s in self.in_rotation]

    @property
    def serving_version(self) -> int:
        """Oldest version any server in rotation serves (-1 with none in rotation)."""
        return min(self.serving_versions(), default=-1)

    def pick(self) -> Server | None:
        """The least-loaded server that takes new requests now. One in the middle of a weight
        update is skipped: it would hold the request until the update ends and then generate
        with the new version, while the group is tagged with the old one and goes stale early."""
        ready = [s for s in self.in_rotation if not s.updating]
        return min(ready, key=lambda s: s.groups, default=None)

    def assign(self, s: Server) -> None:
        s.groups += 1

    def release(self, s: Server) -> None:
        s.groups -= 1

    def succeeded(self, s: Server) -> None:
        """It served a request: its next failure starts a fresh backoff."""
        s.backoff_s = 1.0

    def begin(self, s: Server) -> None:
        if s.in_flight == 0 and s.idle_since is not None:
            s.idle_s += time.monotonic() - s.idle_since
            s.idle_since = None
        s.in_flight += 1

    def end(self, s: Server) -> None:
        s.in_flight -= 1
        if s.in_flight == 0:
            s.idle_since = time.monotonic()

    def take_idle_s(self) -> float:
        """Server-seconds spent with nothing in flight since the previous call (servers in
        rotation only: a dead server is not idle capacity)."""
        now, total = time.monotonic(), 0.0
        for s in self.in_rotation:
            if s.idle_since is not None:
                s.idle_s += now - s.idle_since
                s.idle_since = now
            total += s.idle_s
        for s in self.servers:
            s.idle_s = 0.0
        return total

    def fail(self, s: Server, reason: str, gone: bool = False) -> None:
        """Out of rotation. `gone`: it no longer answers at all (health check, heartbeat), so its
        groups in flight will not finish either: on_fail requeues them. After a failed request
        the others may well finish, and are left to."""
        if not s.healthy:
            return
        s.healthy = False
        s.last_error = reason
        if s.update is not None:
            s.update.cancel()
        wait = self._back_off(s)
        log.warning("server %s out of rotation (%s); %d of %d left, retry in %.0f s",
                    s.url, reason, len(self.in_rotation), len(self.servers), wait)
        if gone and self.on_fail is not None:
            self.on_fail(s)

    def find(self, url: str) -> Server | None:
        url = url.rstrip("/")
        return next((s for s in self.servers if s.url == url), None)

    def add(self, url: str, why: str) -> Server:
        """A server not listed in the config: it joins once it answers /health (heal)."""
        s = Server(InferenceClient(url.rstrip("/"), self.session, self.token), listed=False)
        self.servers.append(s)
        log.info("server %s %s; it joins once healthy", s.url, why)
        return s

    def remove(self, s: Server, why: str) -> None:
        """Forget a discovered server: it stopped or is gone (its groups are requeued)."""
        self.fail(s, why, gone=True)
        if s in self.servers:
            self.servers.remove(s)
        log.warning("server %s left the pool (%s); %d server(s) in rotation", s.url, why, len(self.in_rotation))

    def _back_off(self, s: Server) -> float:
        wait = s.backoff_s
        s.retry_at = time.monotonic() + wait
        s.backoff_s = min(2 * wait, self.retry_max_s)
        return wait

    # --- start-up and health -------------------------------------------------------------

    def joins(self, s: Server, health: dict) -> bool:
        """At start-up: `s` answered; it joins unless another program answers at its URL, said
        once per reason (it is asked again: the run's own server may just not be announced yet)."""
        problem = self.impostor(s, health)
        if problem and problem != s.last_error:
            log.warning("server %s not joining: %s", s.url, problem)
        s.last_error = problem or ""
        return problem is None

    async def connect(self, timeout_s: float, every: bool = False) -> None:
        """Wait until a first server answers /health (servers start in ~30 s on a CPU), or with
        `every` until all listed ones do (a broadcast group needs every member at once). Those
        that answer later join through heal()."""
        deadline, last_beat = time.monotonic() + timeout_s, time.monotonic()
        while True:
            pending = [s for s in self.servers if not s.joined]
            results = await asyncio.gather(*(s.client.health() for s in pending), return_exceptions=True)
            for s, r in zip(pending, results):
                if isinstance(r, BaseException):
                    s.last_error = str(r)
                elif self.joins(s, r):
                    self.note(s, r)
                    s.healthy = s.joined = True
                    s.idle_since = time.monotonic()
            left = [s for s in self.servers if not s.joined]
            ready = not left if every else bool(self.in_rotation)
            if ready:
                return
            if time.monotonic() > deadline:
                named = ", ".join(f"{s.url} ({s.last_error or 'no answer'})" for s in left)
                raise TimeoutError(f"inference server(s) {named} not healthy after {timeout_s:.0f} s "
                                   "(orchestrator.timeouts.server_wait_s)")
            if time.monotonic() - last_beat > 10:
                log.info("waiting for inference server(s) %s to come up", ", ".join(s.url for s in left))
                last_beat = time.monotonic()
            # A refused connection costs next to nothing; every second of this wait is the run's start.
            await asyncio.sleep(0.25)

    async def check(self) -> None:
        """A server whose host is cut off answers nothing; one restarted between two requests
        comes back serving the base model and fails nothing: compare what each one reports with
        what it should serve (not while it updates: /health answers then, the version moves)."""
        servers = list(self.in_rotation)
        results = await asyncio.gather(*(s.client.health() for s in servers), return_exceptions=True)
        for s, r in zip(servers, results):
            if not s.healthy:
                continue  # changed while we asked
            if isinstance(r, BaseException):
                self.fail(s, f"health check failed: {r}", gone=True)
            elif problem := self.impostor(s, r):
                self.fail(s, problem, gone=True)  # ours is gone: its groups will not finish
            elif not s.updating and not self.delivery.still_serves(s, r):
                self.fail(s, f"reports version {self.delivery.reported_version(r)}, expected {s.version} (restarted?)")

    async def heal(self, alone_timeout_s: float, check_every_s: float = 2.0) -> None:
        """Check the servers in rotation; retry those out of it, with backoff (joining ones every
        second), and bring them to the current version before they take requests: one (re)joins
        serving the pool's version at that moment (`pool.version`). Until no server has been in
        rotation for `alone_timeout_s`: then the run cannot go on (Spinning, naming each one)."""
        last_check = alone_since = time.monotonic()
        while True:
            now = time.monotonic()
            if self.in_rotation:
                alone_since = now
            elif now - alone_since > alone_timeout_s:
                raise Spinning(self.none_in_rotation(now - alone_since))
            if now - last_check > check_every_s:
                await self.check()
                last_check = now
            for s in list(self.servers):
                if not (s.healthy or s.silent or now < s.retry_at):
                    await self.rejoin(s)
            await asyncio.sleep(0.2)

    async def rejoin(self, s: Server) -> None:
        """One try to bring `s`, out of rotation and due for a retry, back: its /health, then the
        current version, then into rotation; on failure its next retry (backoff once it had
        joined, every second while it may still be starting)."""
        try:
            health = await s.client.health()
            if s not in self.servers:
                return  # removed while we asked: a re-added one with its URL is another
            if problem := self.impostor(s, health):
                raise InferenceError(f"{s.url}: {problem}")
            self.note(s, health)
            # Until it serves the current version: a load() while it was brought to one
            # moved the version on (and skipped it: it is not in rotation yet), so it is
            # brought again, and it joins serving exactly the pool's version. `target`
            # is read before each await: the server is recorded with what it loaded.
            while s.version != (target := self.delivery.target).version and target.path:
                await self.delivery.load_one(s, target)
                self.serving(s, target.version)
        except InferenceError as e:
            s.last_error = str(e)
            if s.joined:
                log.warning("server %s still down (%s); retry in %.0f s", s.url, e, self._back_off(s))
            else:  # still starting (vLLM takes a while), or never coming
                s.retry_at = time.monotonic() + 1.0
                if s.retry_at - s.noted_at > 30:
                    log.info("server %s not up yet (%s)", s.url, e)
                    s.noted_at = s.retry_at
            return
        if s not in self.servers:
            return  # removed while we asked
        # backoff_s is reset by the first request it serves, not here: a server that
        # answers /health but fails every request must not be retried every second.
        s.healthy, s.idle_since = True, time.monotonic()
        log.info("server %s %s, serving version %d; %d server(s) in rotation", s.url,
                 "back in rotation" if s.joined else "joined", s.version, len(self.in_rotation))
        s.joined = True

    def none_in_rotation(self, for_s: float) -> str:
        servers = "; ".join(f"{s.url} ({s.last_error or 'no error recorded'})" for s in self.servers)
        return (f"no inference server in rotation for {for_s:.0f} s (orchestrator.timeouts.server_wait_s): "
                f"{servers or 'none left in the pool'}; stopping: restart or fix them (rl inference), or "
                "check orchestrator.servers.urls")

    async def discover(self, output_dir: Path, exclude: set[str], timeout_s: float,
                       every_s: float = DISCOVER_EVERY_S) -> None:
        """Forever: follow the servers that announce themselves in output_dir/heartbeats/: add
        each new one, take out one whose heartbeat stops (removed or silent for `timeout_s`),
        forgetting it unless listed, and let it in again when it beats again."""
        watches: dict[str, PeerWatch] = {}
        # (instance, serving?) last seen per URL: a server is asked at once when it starts and
        # again when it declares itself ready, not after the backoff its predecessor's failures
        # grew (up to servers.retry_max_s: a restarted vLLM takes ~20-30 s to get ready).
        instances: dict[str, tuple[str | None, bool]] = {}
        while True:
            # Only new files are read here: the watches read the known ones.
            watched = {w.path for w in watches.values()}
            for path in server_heartbeats(output_dir):
                if path not in watched and (url := announced_url(path)) and url not in exclude:
                    watches[url] = PeerWatch(path, f"server {url}", timeout_s)
            for url, watch in list(watches.items()):
                peer = watch.poll()
                s = self.find(url)
                if peer.state == "alive":
                    if s is None:
                        s = self.add(url, f"announced itself ({watch.instance})")
                    seen = (watch.instance, watch.phase == SERVING)
                    if s.silent or instances.get(url) != seen:
                        s.silent, s.retry_at, s.backoff_s = False, 0.0, 1.0  # new, back or ready: ask it now
                    instances[url] = seen
                elif peer.state in ("silent", "stopped"):
                    if s is not None and not s.silent:
                        s.silent = True
                        why = peer.describe() if peer.state == "silent" else "stopped: its heartbeat was removed"
                        if s.listed:
                            self.fail(s, why, gone=True)
                        else:
                            self.remove(s, why)
                    if peer.state == "stopped":
                        del watches[url]
            await asyncio.sleep(every_s)
