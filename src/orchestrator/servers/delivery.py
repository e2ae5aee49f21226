"""How a weights version reaches the inference servers, as the orchestrator drives it: one
WeightDelivery per run, of the kind the config names (weight_delivery), chosen once.

- files (FileDelivery): each server reloads weights/step_n from the run directory.
- broadcast (BroadcastDelivery): every worker of every server is a rank of the trainer's group:
  prepare() hands out the ranks, and each version is posted to every server, in rotation or not,
  because the trainer's broadcast needs all of them at once.
- LoRA adapters (AdapterDelivery): a version is an adapter, "<prefix>-v<version>", loaded next to
  the others with /load_lora_adapter: nothing pauses, each group names the adapter it started on
  (so its tokens carry exactly that version), and versions no group needs any more are unloaded.
  Version 0 is the base model, no adapter.

Weight paths go to the servers relative to the run directory ("weights/step_3"): every host may
mount the shared directory at its own path. The base model is "base", whatever its path here.

The pool (orchestrator/servers/pool.py) decides who is in rotation; a delivery brings servers to a
version and tells the pool what a server's /health says it serves.
"""

from __future__ import annotations

import asyncio
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from orchestrator.servers.server import Server
from rl.weights.broadcast import MANIFEST
from rl.inference_api import InferenceError

if TYPE_CHECKING:
    from rl.config import RunConfig


class ServerPool(Protocol):
    """What a delivery reads of the pool (orchestrator/servers/pool.py) and reports to it: the pool
    owns every server's state."""

    servers: list[Server]

    @property
    def in_rotation(self) -> list[Server]: ...

    def fail(self, s: Server, why: str, gone: bool = False) -> None: ...

    def serving(self, s: Server, version: int) -> None: ...

    def updating(self, s: Server, update: asyncio.Task | None) -> None: ...

    def updated(self, s: Server) -> None: ...

log = logging.getLogger("orchestrator")

ANSWER_MARGIN_S = 10.0  # beyond a server's own timeout: its answer says what ran late


@dataclass(frozen=True)
class Target:
    """A version as the servers are told to load it."""
    version: int
    path: str
    """As sent: relative to the run directory, "base" for version 0 ("": none asked for yet)."""
    local_path: Path | None
    """The same, as this host sees it."""


class WeightDelivery(ABC):
    """Brings the pool's servers to a version. The pool calls load_one() and seen() while healing,
    still_serves() and reported_version() while checking; the orchestrator calls the rest."""

    fixed_members = False
    """Every listed server must be there from the start and none joins later: connect waits for
    all of them and no server is discovered."""

    def __init__(self, pool: ServerPool, reload_timeout_s: float, root: Path | None):
        """`root`: the run directory weight paths are sent relative to (None: absolute)."""
        self.pool, self.reload_timeout_s, self.root = pool, reload_timeout_s, root
        self.target = Target(0, "", None)  # what every server in rotation must serve

    async def prepare(self) -> None:
        """Once every server is connected, before the first load."""

    async def load(self, version: int, path: Path) -> None:
        """Make every server in rotation serve `version`; a server that fails leaves rotation."""
        self.target = Target(version, self.wire_path(version, path), path)
        await self._load(self.target)

    @abstractmethod
    async def _load(self, target: Target) -> None:
        """Bring every server in rotation to `target`."""

    @abstractmethod
    async def load_one(self, s: Server, target: Target) -> float:
        """Bring one server to `target` (the caller records it serving); returns its load seconds."""

    def wire_path(self, version: int, path: Path) -> str:
        """How a server finds `path`: relative to the run directory (each host mounts it where
        it likes), "base" for the model the servers started with, else absolute."""
        if version == 0:
            return "base"
        if self.root is not None:
            try:
                return path.resolve().relative_to(self.root.resolve()).as_posix()
            except ValueError:
                pass
        return str(path.resolve())

    # --- what a server reports -----------------------------------------------------------

    def reported_version(self, health: dict) -> int:
        """The version a server's /health says it serves."""
        return health["version"]

    def seen(self, s: Server, health: dict) -> None:
        """What a server (joining, or answering again) reports beyond its version (the pool
        recorded that: reported_version)."""

    def still_serves(self, s: Server, health: dict) -> bool:
        """Whether the server still serves what we recorded."""
        return health.get("version") == s.version

    # --- adapters: none but with AdapterDelivery -----------------------------------------

    def adapter(self, version: int) -> str | None:
        """The adapter a request for `version` names (None: the base weights)."""
        return None

    async def unload_unused(self, in_use: Iterable[tuple[Server, int]], keep_current: bool = True) -> int:
        """Unload what no group needs any more; returns how many are left."""
        return 0

    async def unload_all(self, timeout_s: float = 10.0) -> None:
        """Unload everything this run loaded (the run is over)."""

    def take_update_s(self) -> float | None:
        """Mean seconds from a version's discovery to every server serving it, since the
        previous call (None: no update since)."""
        return None


class FileDelivery(WeightDelivery):
    """Each server pauses and reloads the version from its directory (/update_weights)."""

    def __init__(self, pool: ServerPool, reload_timeout_s: float, root: Path | None, in_flight_updates: bool):
        super().__init__(pool, reload_timeout_s, root)
        self.mode = "keep" if in_flight_updates else "wait"
        self.update_s: list[float] = []  # each full-weights update's duration, until reported

    def _members(self, target: Target) -> tuple[list[Server], bool]:
        """The servers to update, and whether one may be dropped half-way (leaving rotation
        cancels its update)."""
        return self.pool.in_rotation, True

    def _timeout_s(self, local_path: Path | None) -> float:
        # The server bounds the update by reload_timeout_s itself and then answers 504 saying
        # why; waiting a little longer here lets that answer, not a bare client timeout, arrive.
        return self.reload_timeout_s + ANSWER_MARGIN_S

    async def _load(self, target: Target) -> None:
        version = target.version
        members, droppable = self._members(target)
        stale = [s for s in members if s.version != version]
        started = time.monotonic()
        timeout = self._timeout_s(target.local_path)
        tasks = [asyncio.create_task(s.client.update_weights(target.path, version, self.mode, timeout))
                 for s in stale]
        for s, task in zip(stale, tasks):
            self.pool.updating(s, task if droppable else None)
        try:
            results = await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            for s in stale:
                self.pool.updated(s)
        reload_s = []
        for s, r in zip(stale, results):
            if isinstance(r, BaseException):
                self.pool.fail(s, f"weight update to version {version} failed: {r}")
            else:
                self.pool.serving(s, version)
                reload_s.append(r.get("reload_s", 0.0))
        if reload_s:
            self.update_s.append(time.monotonic() - started)
            log.info("version %d serving on %d server(s) (reload %.3f s, mode %s)",
                     version, len(reload_s), max(reload_s), self.mode)

    async def load_one(self, s: Server, target: Target) -> float:
        r = await s.client.update_weights(target.path, target.version, self.mode, self._timeout_s(target.local_path))
        return r.get("reload_s", 0.0)

    def take_update_s(self) -> float | None:
        taken, self.update_s = self.update_s, []
        return sum(taken) / len(taken) if taken else None


class BroadcastDelivery(FileDelivery):
    """The trainer streams each version (weights/step_n holds only its manifest) to every
    server's workers at once; the base model still loads from its files."""

    fixed_members = True  # the group forms once, with every server (docs/architecture.md)

    def __init__(self, pool: ServerPool, reload_timeout_s: float, root: Path | None, in_flight_updates: bool,
                 address: str, timeout_s: float):
        super().__init__(pool, reload_timeout_s, root, in_flight_updates)
        self.address, self.timeout_s = address, timeout_s

    @staticmethod
    def _streamed(local_path: Path | None) -> bool:
        return local_path is not None and (local_path / MANIFEST).is_file()

    def _members(self, target: Target) -> tuple[list[Server], bool]:
        if not self._streamed(target.local_path):
            return super()._members(target)
        # A broadcast waits for every member: servers out of rotation that still answer take
        # part (and so stay current), one that is gone fails the trainer's broadcast loudly.
        # A broadcast cannot drop a member half-way: the trainer's collective needs it.
        return self.pool.servers, False

    def _timeout_s(self, local_path: Path | None) -> float:
        # A broadcast version already delivered is refused at once (409), one still being
        # broadcast is received: the server waits for the trainer's broadcast, too.
        return self.reload_timeout_s + ANSWER_MARGIN_S + (self.timeout_s if self._streamed(local_path) else 0.0)

    async def prepare(self) -> None:
        """Every server's workers join the trainer's broadcast group (after connect, before any
        load: the trainer's first broadcast needs every server in the group). Rank 0 is trainer
        rank 0, then each server's workers in servers.urls order; all servers are asked at once,
        because the group forms only when every member has joined."""
        servers = self.pool.servers
        infos = await asyncio.gather(*(s.client.broadcaster() for s in servers), return_exceptions=True)
        failed = [f"{s.url}: {r}" for s, r in zip(servers, infos) if isinstance(r, BaseException)]
        if failed:
            raise RuntimeError(f"weight broadcast group at {self.address}: cannot count the servers' "
                               "workers: " + "; ".join(failed))
        offsets, rank = [], 1
        for info in infos:
            offsets.append(rank)
            rank += int(info["workers"])
        world = rank
        log.info("joining %d server(s) (%d workers) to the weight broadcast group at %s",
                 len(servers), world - 1, self.address)
        results = await asyncio.gather(*(
            s.client.init_broadcaster(self.address, offset, world, self.timeout_s + 60)
            for s, offset in zip(servers, offsets)), return_exceptions=True)
        failed = [f"{s.url}: {r}" for s, r in zip(servers, results) if isinstance(r, BaseException)]
        if failed:
            # The trainer cannot publish a single version without every member.
            raise RuntimeError(f"weight broadcast group at {self.address} not formed: " + "; ".join(failed))
        log.info("weight broadcast group at %s formed: world size %d", self.address, world)


class AdapterDelivery(WeightDelivery):
    """LoRA: version v is the adapter "<prefix>-v<v>", loaded next to those serving."""

    def __init__(self, pool: ServerPool, reload_timeout_s: float, root: Path | None, prefix: str):
        super().__init__(pool, reload_timeout_s, root)
        self.prefix = prefix
        self.loaded: dict[str, set[int]] = {}
        """Per server URL: the adapter versions this run loaded there and has not unloaded."""

    def adapter(self, version: int) -> str | None:
        return f"{self.prefix}-v{version}" if version > 0 else None

    async def _load(self, target: Target) -> None:
        """Load the adapter next to those serving; no server pauses, so none is marked updating
        (a group started meanwhile names the older adapter and is tagged with it)."""
        version = target.version
        stale = [s for s in self.pool.in_rotation if s.version != version]

        async def load(s: Server) -> float:
            seconds = await self.load_one(s, target)
            self.pool.serving(s, version)  # at once: new groups there name the new adapter
            return seconds

        results = await asyncio.gather(*(load(s) for s in stale), return_exceptions=True)
        load_s = []
        for s, r in zip(stale, results):
            if isinstance(r, BaseException):
                self.pool.fail(s, f"loading adapter {self.adapter(version)} failed: {r}")
            else:
                load_s.append(r)
        if load_s:
            log.info("version %d (adapter %s) serving on %d server(s) (load %.3f s)", version,
                     self.adapter(version), len(load_s), max(load_s))

    async def load_one(self, s: Server, target: Target) -> float:
        r = {"load_s": 0.0}
        if target.version > 0:
            # Recorded first: a load cut short here (a SIGTERM) may still land on the server,
            # and unload_all must ask for it (a 404 if it never did).
            self.loaded.setdefault(s.url, set()).add(target.version)
            r = await s.client.load_lora_adapter(self.adapter(target.version), target.path, target.version,
                                                 self.reload_timeout_s)
        return r.get("load_s", 0.0)

    def _ours(self, health: dict) -> set[int]:
        """The versions of this run's adapters a server's /health lists."""
        return {v for name, v in health.get("adapters", {}).items() if name == self.adapter(v)}

    def reported_version(self, health: dict) -> int:
        """The newest of our adapters."""
        return max(self._ours(health), default=0)

    def seen(self, s: Server, health: dict) -> None:
        # From an earlier orchestrator: unloaded once unused. What a restart lost is not there
        # to unload.
        self.loaded[s.url] = self._ours(health)

    def still_serves(self, s: Server, health: dict) -> bool:
        """Ours is loaded (a newer one may be, too: a load can finish on the server before we
        record it)."""
        return s.version == 0 or s.version in self._ours(health)

    async def unload_unused(self, in_use: Iterable[tuple[Server, int]], keep_current: bool = True) -> int:
        """Unload adapter versions that are neither current (unless keep_current is false) nor
        used by a group or an evaluation in flight (in_use: the server and version each started
        on). A server that still runs a request on one answers 409 and is asked again next time.
        Returns how many are left."""
        pinned: dict[int, set[int]] = {}
        for server, v in in_use:
            pinned.setdefault(id(server), set()).add(v)
        left = 0
        for s in self.pool.in_rotation:
            current = {s.version} if keep_current else set()
            loaded = self.loaded.setdefault(s.url, set())
            for v in sorted(loaded - current - pinned.get(id(s), set())):
                try:
                    await s.client.unload_lora_adapter(self.adapter(v))
                except InferenceError as e:
                    if "HTTP 404" not in str(e):  # 404: gone already (a restart), forget it
                        left += 1
                        continue
                loaded.discard(v)
        return left

    async def unload_all(self, timeout_s: float = 10.0) -> None:
        """Unload every adapter version this pool loaded (the run is over). Requests just
        aborted may hold one for a moment (409), hence the retries."""
        deadline = time.monotonic() + timeout_s
        while await self.unload_unused((), keep_current=False) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)


DELIVERIES: dict[str, Callable[[RunConfig, ServerPool], WeightDelivery]] = {
    "files": lambda cfg, pool: FileDelivery(pool, cfg.inference.timeouts.reload_s, cfg.output_dir,
                                            cfg.orchestrator.scheduling.in_flight_updates),
    "broadcast": lambda cfg, pool: BroadcastDelivery(pool, cfg.inference.timeouts.reload_s, cfg.output_dir,
                                                     cfg.orchestrator.scheduling.in_flight_updates, cfg.weight_sync.address,
                                                     cfg.timeouts.broadcast_s),
    "adapters": lambda cfg, pool: AdapterDelivery(pool, cfg.inference.timeouts.reload_s, cfg.output_dir,
                                                  cfg.adapter_prefix),
}
"""One line per kind of RunConfig.weight_delivery."""


def weight_delivery(cfg: RunConfig, pool: ServerPool) -> WeightDelivery:
    """The run's kind of delivery, chosen once."""
    return DELIVERIES[cfg.weight_delivery](cfg, pool)
