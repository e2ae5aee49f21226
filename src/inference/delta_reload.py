"""The delta kind of Reload on the server (weight_sync.delta): the workers keep each full version
they load as a base in host memory (staging.py full_files); a directory holding delta.json is
rebuilt from that base (delta_rebuild.py, rl/weights/delta.py) and loaded, or refused with 409
before the update lock when its base is not the one it names.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import HTTPException

from inference.all_workers import staged
from inference.reload_kinds import FilesReload, Reload
from rl.weights import delta as wd
from rl.rundir import STABLE


class DeltaFiles(FilesReload):
    """FilesReload with weight_sync.delta: a full version is kept in the workers' host memory as
    the base of later deltas (staging.py full_files), a directory holding
    delta.json is rebuilt from that base (ApplyDelta). `held` is the base the workers hold."""

    def __init__(self, timeout_s: float):
        super().__init__(timeout_s)
        self.held: wd.Digest | None = None

    def prepare(self, path: Path, version: int) -> Reload:
        if not (path / wd.MANIFEST).is_file():
            return super().prepare(path, version)
        try:
            manifest = wd.read_manifest(path)
        except (OSError, ValueError) as e:
            raise HTTPException(422, f"path: {path}/{wd.MANIFEST} is malformed: {e}") from None
        if manifest.version != version:
            raise HTTPException(400, f"version: {version}, but {path}/{wd.MANIFEST} is version {manifest.version}")
        if self.held != manifest.base:
            check_base(path, manifest)
        return ApplyDelta(self)

    async def load(self, engine, path: Path, version: int) -> None:
        held = (await staged(engine, "asyncrl_stage_full", self.timeout_s, str(path)))[0]["base"]
        self.held = None if held is None else wd.Digest(*held)


class ApplyDelta(Reload):
    """One delta: the workers rebuild the version from their base and load it."""

    def __init__(self, files: DeltaFiles):
        self.files, self.timeout_s = files, files.timeout_s

    def prepare(self, path: Path, version: int) -> Reload:
        return self.files.prepare(path, version)

    async def load(self, engine, path: Path, version: int) -> None:
        out = await staged(engine, "asyncrl_stage_delta", self.timeout_s, str(path))
        self.files.held = wd.Digest(*out[0]["base"])


def check_base(path: Path, manifest: wd.Manifest) -> None:
    """Before the update lock: 409 when the delta's base is not there to be read, or is not the
    one it names (another run's, or another version written under that number). Damage inside
    the base's files shows only when the worker reads them (it checks their checksum)."""
    base = wd.base_dir(path, manifest)
    refused = f"version {manifest.version} at {path}: {wd.REFUSED}:"
    if not (base / STABLE).is_file():
        raise HTTPException(409, f"{refused} its base, version {manifest.base_version}, is missing ({base}); a "
                                 "server catches up through the last full version, which trainer.files.keep_weights keeps")
    try:
        digest = wd.Digest.read(base)
    except (OSError, ValueError) as e:
        raise HTTPException(409, f"{refused} its base {base} has no readable {wd.DIGEST} ({e})") from None
    if digest.run_id != manifest.run_id:
        raise HTTPException(409, f"{refused} it belongs to run {manifest.run_id}, its base {base} to run "
                                 f"{digest.run_id}")
    if digest != manifest.base:
        raise HTTPException(409, f"{refused} it is against version {manifest.base_version} with checksum "
                                 f"{manifest.base_checksum}, {base} holds version {digest.version} with checksum "
                                 f"{digest.checksum}")
