"""A version every worker checks before any worker loads it: all workers or none.

Under tensor (or pipeline) parallelism each worker loads its own shards, and each checks what it
will load on its own (a delta rebuilt from the base it holds, a full version against its digest).
Were each to check and load in one call, a worker that refused (a damaged base, a checksum that
does not match, a MemoryError while reading) would leave the others on the new weights and the
server labelling their mix with the old version. So a reload that can be refused runs in two
rounds (inference/all_workers.py `staged`):

    asyncrl_stage_*   every worker reads and checks what it would load, holds it ready (a
                      Staged) or says why not ({"refused": why}); the engine is not touched
    asyncrl_commit    no worker refused: each loads what it holds
    asyncrl_discard   some worker refused: each drops what it holds (a delta's base gets its own
                      values back; a broadcast's sender is told the version failed)

A full version without a digest has nothing to check: it is staged as "load it", and a load that
fails half-way is rolled back by the server like any failed load.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("vllm.asyncrl")

KEEP = "keep"
"""Staged.base when the load leaves the base the worker holds as it is (a full version without a
digest: later deltas are against the base still)."""


@dataclass
class Staged:
    """What one worker holds between asyncrl_stage_* and asyncrl_commit / asyncrl_discard."""

    load: Callable | None = None
    """load(worker): puts the version into the engine."""
    refused: str = ""
    base: object = KEEP
    """The BaseVersion the worker holds once loaded (KEEP: the one it holds now)."""
    info: dict = field(default_factory=dict)
    """Said in the commit's answer: the checksum the worker computed, what it received."""
    undo: ExitStack = field(default_factory=ExitStack)
    """Closed after the load or the discard: a delta's base gets its own values back."""
    incoming: object = None
    """A broadcast's rl.weights.broadcast.Incoming: acknowledged (ok or failed) at commit or discard."""
    what: str = ""
    """For the log: "version 4 rebuilt from version 1 + 130 changed values"."""

    def answer(self) -> dict:
        return {"refused": self.refused} if self.refused else {}


def stage(worker, make: Callable[..., Staged], arg: str) -> dict:
    """Hold what make(worker, arg) stages on the worker; whatever an earlier round left there is
    dropped first (a delta's base patched by it would not rebuild the next one)."""
    discard(worker)
    staged = worker._asyncrl_staged = make(worker, arg)
    return staged.answer()


def commit(worker) -> dict:
    """Load what the worker holds (every worker passed its checks); the answer says what it loaded."""
    staged, worker._asyncrl_staged = getattr(worker, "_asyncrl_staged", None), None
    if staged is None or staged.refused or staged.load is None:
        raise RuntimeError("asyncrl_commit: this worker holds no version ready to load (asyncrl_stage_* first)")
    ok = False
    start = time.perf_counter()
    try:
        staged.load(worker)
        ok = True
    finally:
        staged.undo.close()
        if staged.incoming is not None:
            finish(worker, staged.incoming, ok)
    if staged.base is not KEEP:
        worker._asyncrl_base = staged.base
    info = dict(staged.info, load_s=time.perf_counter() - start)
    if staged.incoming is not None:
        info["received_bytes"] = staged.incoming.received_bytes
    if staged.what:
        said = [f"checksum {info['checksum']}"] if "checksum" in info else []
        said += [f"{info['received_bytes']} bytes received"] if "received_bytes" in info else []
        log.info("%s, loaded in %.3f s%s", staged.what, info["load_s"], f" ({', '.join(said)})" if said else "")
    return {"base": worker._asyncrl_held(), **info}


def discard(worker) -> dict:
    """Drop what the worker holds (some worker refused, or an earlier round was left)."""
    staged, worker._asyncrl_staged = getattr(worker, "_asyncrl_staged", None), None
    if staged is not None:
        staged.undo.close()
        if staged.incoming is not None:
            finish(worker, staged.incoming, False)
    return {}


def finish(worker, incoming, ok: bool) -> None:
    """Acknowledge a broadcast version to its sender; a group that fails here is out of step."""
    try:
        incoming.finish(ok)
    except Exception as e:
        worker._asyncrl_broken = str(e)
        raise


# --- what each kind of version stages -----------------------------------------------------------


def full_files(worker, path: str) -> Staged:
    """A full version's files: read and checked against its digest.json when it has one (kept
    as the base of later deltas), else nothing to check."""
    from inference.delta_rebuild import BaseVersion
    from rl.weights import delta as wd

    base = KEEP
    if (Path(path) / wd.DIGEST).is_file():
        try:
            base = BaseVersion.read(path)
        except wd.DeltaRefused as e:
            return Staged(refused=str(e))
    return Staged(load=lambda w: w.asyncrl_reload_weights(path), base=base)


def delta_files(worker, path: str) -> Staged:
    """A delta's files: rebuilt from the base (held, or read from its directory) in place and
    checked against the version's checksum; loaded from memory at commit."""
    from safetensors.torch import load_file

    from inference.delta_rebuild import rebuilt
    from rl.weights import delta as wd

    start = time.perf_counter()
    manifest = wd.read_manifest(path)
    staged = Staged()
    try:
        base = worker._asyncrl_base_for(manifest, wd.base_dir(path, manifest))
        tensors, checksum = staged.undo.enter_context(rebuilt(base, manifest, load_file(Path(path) / wd.TENSORS)))
    except wd.DeltaRefused as e:
        staged.undo.close()
        return Staged(refused=str(e))
    staged.load = lambda w: w._asyncrl_load_tensors(iter(tensors.items()))
    staged.base = base
    staged.info = {"checksum": checksum, "rebuild_s": time.perf_counter() - start}
    staged.what = (f"version {manifest.version} rebuilt from version {manifest.base_version} + {manifest.changed} "
                   f"changed values in {staged.info['rebuild_s']:.3f} s")
    return staged


def broadcast(worker, manifest_path: str) -> Staged:
    """A version arriving by broadcast (rl/weights/broadcast.py). A delta's changed values, and a full
    version with a digest, are received whole before anything is loaded, and checked (the delta
    rebuilt against its checksum, the full tensors against the digest's); a full version without
    a digest streams into the load at commit, bucket by bucket, unchecked (there is nothing to
    check it against)."""
    from rl.weights import broadcast as bc
    from rl.weights import delta as wd

    group = getattr(worker, "_asyncrl_group", None)
    if group is None:
        raise RuntimeError("this worker is not in a broadcast group (POST /init_broadcaster first)")
    if getattr(worker, "_asyncrl_broken", None):
        raise RuntimeError(f"the broadcast group is out of step since an earlier failure "
                           f"({worker._asyncrl_broken}); restart the servers and the trainer")
    directory = Path(manifest_path).parent
    manifest = bc.Manifest.from_json(Path(manifest_path).read_bytes())
    try:
        incoming = bc.Incoming(group, manifest)
    except Exception as e:
        worker._asyncrl_broken = str(e)
        raise
    try:
        if (directory / wd.MANIFEST).is_file():
            staged = _broadcast_delta(worker, directory, incoming)
        elif (directory / wd.DIGEST).is_file():
            staged = _broadcast_full_checked(directory, incoming)
        else:
            staged = Staged(load=lambda w: w._asyncrl_load_tensors(incoming.tensors()))
    except BaseException:
        finish(worker, incoming, False)  # the collectives stay in step with the sender
        raise
    staged.incoming = incoming
    staged.what = staged.what or (f"received version {manifest.version} by broadcast ({len(manifest.buckets)} "
                                  f"buckets, {manifest.total_bytes / 2**20:.1f} MB)")
    return staged


def _broadcast_delta(worker, directory: Path, incoming) -> Staged:
    from inference.delta_rebuild import rebuilt
    from rl.weights import delta as wd

    manifest = wd.read_manifest(directory)
    changes = dict(incoming.tensors())
    base = getattr(worker, "_asyncrl_base", None)
    if base is None or base.digest != manifest.base:
        return Staged(refused=f"{wd.REFUSED}: version {manifest.version} is a delta against version "
                              f"{manifest.base_version}, which this worker does not hold (a broadcast base cannot "
                              "be read back)")
    staged = Staged(base=base)
    try:
        tensors, checksum = staged.undo.enter_context(rebuilt(base, manifest, changes))
    except wd.DeltaRefused as e:
        staged.undo.close()
        return Staged(refused=str(e))
    staged.load = lambda w: w._asyncrl_load_tensors(iter(tensors.items()))
    staged.info = {"checksum": checksum}
    staged.what = (f"version {manifest.version} rebuilt from version {manifest.base_version} + {manifest.changed} "
                   "changed values received by broadcast")
    return staged


def _broadcast_full_checked(directory: Path, incoming) -> Staged:
    """Every tensor received into host memory (on CPU a view into its bucket's buffer; from a
    GPU one bucket at a time is on the device), then checked against the digest: the copy is
    the base later deltas are rebuilt from, kept anyway."""
    from inference.delta_rebuild import BaseVersion
    from rl.weights import delta as wd

    digest = wd.Digest.read(directory)
    kept = {name: t if t.device.type == "cpu" else t.cpu() for name, t in incoming.tensors()}
    got = wd.checksum(kept)
    if got != digest.checksum:
        return Staged(refused=f"version {digest.version} arrived by broadcast with checksum {got}, its "
                              f"{wd.DIGEST} says {digest.checksum}: refused before loading")
    return Staged(load=lambda w: w._asyncrl_load_tensors(iter(kept.items())), base=BaseVersion(digest, kept),
                  info={"checksum": got},
                  what=f"received version {digest.version} by broadcast, checked against its digest")
