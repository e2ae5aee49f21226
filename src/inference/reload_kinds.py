"""How the workers load version v from the directory the trainer delivered: a Reload, one
implementation per kind, chosen by the server (reload.py ServedWeights) and swapped once its
workers join a broadcast group.

  FilesReload       the workers read the directory's safetensors
  DeltaFiles        FilesReload with weight_sync.delta (delta_reload.py): a directory holding
                    delta.json is rebuilt from the base the workers hold, or refused before the
                    engine is touched
  BroadcastReceive  the directory holds broadcast.json: the workers receive the tensors (or a
                    delta's changed values) from the trainer's broadcast (rl/weights/broadcast.py); any
                    other directory is files

A Reload's `prepare` runs before the update lock, so a refusal waits behind no reload; what only
the workers can refuse is checked on every worker before any loads it (all_workers.py staged).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

from fastapi import HTTPException

from inference.all_workers import Refused, every_worker, staged, timed_out
from rl.weights import broadcast as bc
from rl.weights import delta as wd


def rpc_error(what: str, e: Exception) -> HTTPException:
    text = str(e) or type(e).__name__
    return HTTPException(504 if timed_out(e) else 500, f"{what} failed: {text[:1000]}")


class Reload(ABC):
    """How the workers load version v from a directory the trainer delivered."""

    timeout_s: float
    """Longest an update by this reload may take, waiting for the update lock and the pause
    included, before /update_weights answers 504."""

    group: tuple[str, int, int] | None = None
    """(address, rank_offset, world_size) of the broadcast group the workers joined, if any."""

    @abstractmethod
    def prepare(self, path: Path, version: int) -> Reload:
        """The reload that loads `path` as `version`, or the HTTPException saying why none can.
        Runs before the update lock: a refusal waits behind no reload."""

    def settled(self, path: Path, version: int, serving: int) -> bool:
        """Under the update lock, the engine serving `serving`: True if `version` needs no reload."""
        return False

    @abstractmethod
    async def load(self, engine, path: Path, version: int) -> None:
        """With the engine paused: load the weights (worker_extension.py)."""


class FilesReload(Reload):
    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s

    def prepare(self, path: Path, version: int) -> Reload:
        if (path / bc.MANIFEST).is_file():
            raise HTTPException(409, f"path: {path} holds a broadcast manifest, but this server is in no "
                                     "broadcast group (POST /init_broadcaster first)")
        if (path / wd.MANIFEST).is_file():
            raise HTTPException(409, f"path: {path} holds a weight delta, but this server's weight_sync.delta "
                                     "is false (it keeps no base to rebuild it from)")
        return self

    async def load(self, engine, path: Path, version: int) -> None:
        await every_worker(engine, "asyncrl_reload_weights", self.timeout_s, (str(path),))


class BroadcastReceive(Reload):
    def __init__(self, files: FilesReload, group: tuple[str, int, int], sync_timeout_s: float):
        self.files = files
        self.group = group
        # The workers' own waits are bounded by timeouts.broadcast_s and name the group; this
        # one only catches a worker that never answers.
        self.timeout_s = files.timeout_s + sync_timeout_s

    def prepare(self, path: Path, version: int) -> Reload:
        if not (path / bc.MANIFEST).is_file():
            return self.files.prepare(path, version)
        try:
            manifest = bc.read_manifest(path)
        except (ValueError, KeyError, TypeError) as e:
            raise HTTPException(422, f"path: {path}/{bc.MANIFEST} is malformed: {e}") from None
        if manifest.version != version:
            raise HTTPException(400, f"version: {version}, but {path}/{bc.MANIFEST} is version {manifest.version}")
        return self

    def settled(self, path: Path, version: int, serving: int) -> bool:
        if serving == version:
            # Already received (another caller asked first): receiving again would wait for a
            # broadcast that never comes.
            return True
        if (path / bc.DELIVERED).exists():
            raise HTTPException(409, f"version {version} was broadcast without this server (it serves "
                                     f"{serving}); it cannot catch up without a restart of the trainer and the "
                                     "servers")
        return False

    async def load(self, engine, path: Path, version: int) -> None:
        try:
            await staged(engine, "asyncrl_stage_broadcast", self.timeout_s, str(path / bc.MANIFEST))
        except Refused:
            raise
        except Exception as e:
            raise rpc_error(f"receiving version {version} by broadcast", e) from None
