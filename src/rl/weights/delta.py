"""Weight deltas (`[weight_sync] delta = true`): the format shared by the trainer, which writes
or broadcasts version n as the values that changed since the last full version, and the
inference workers, which rebuild version n from that base and load it. docs/weight_deltas.md.

    weights/step_b/digest.json      a full version the trainer may publish deltas against: the
                                    run's id and the checksum of its tensors
    weights/step_n/delta.json       a delta (Manifest): run id, version, base version and base
                                    checksum, the checksum of the result, every tensor's dtype,
                                    shape and how many of its values changed
    weights/step_n/delta.safetensors    per changed tensor "<name>/idx" (flat int32 indices, int64
                                    past 2**31 values) and "<name>/val" (the new values, in the
                                    served dtype). With broadcast the same tensors go over the wire
                                    (rl/weights/broadcast.py) and this file is absent.

A delta is always against the last FULL version (not the previous one): any server that can
read that full version, or holds it, can rebuild any later delta on its own, so a server that
joins late or restarts catches up with one full read and one delta. Values are compared as bit
patterns (an integer view of the same width), so -0.0, NaNs and every rounding are carried
exactly: the rebuilt tensors are the very bytes the full file would hold, which the result
checksum proves before a worker loads anything.

JSON and safetensors, never pickle: a server parses what another process wrote. Importing this
module is cheap: torch and xxhash are imported inside the functions that need them.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

MANIFEST = "delta.json"
TENSORS = "delta.safetensors"
DIGEST = "digest.json"
RUN_ID = "RUN_ID"  # weights/RUN_ID: the run's id, written once, kept across trainer restarts
FORMAT = "asyncrl-delta/1"
DIGEST_FORMAT = "asyncrl-digest/1"
# Every refusal starts with this: a delta (or its base) that a worker will not load, found out
# before the engine is touched, so the server answers it without a rollback.
REFUSED = "delta refused"
_INT_OF_WIDTH = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


class DeltaRefused(ValueError):
    """This delta cannot be rebuilt here (its base is missing, damaged or another run's, or the
    result does not match its checksum); nothing was loaded."""

    def __init__(self, why: str):
        super().__init__(f"{REFUSED}: {why}")


# --- identities -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Digest:
    """What identifies a full version's bytes: weights/step_b/digest.json."""

    run_id: str
    version: int
    checksum: str

    def to_json(self) -> bytes:
        return json.dumps({"format": DIGEST_FORMAT, "run_id": self.run_id, "version": self.version,
                           "checksum": self.checksum}).encode()

    @classmethod
    def read(cls, directory: Path | str) -> Digest:
        """The digest of a full version directory; ValueError (or OSError) saying what is wrong."""
        data = json.loads((Path(directory) / DIGEST).read_bytes())
        if not isinstance(data, dict) or data.get("format") != DIGEST_FORMAT:
            raise ValueError(f"not a {DIGEST_FORMAT} file")
        out = cls(data.get("run_id"), data.get("version"), data.get("checksum"))
        if not (isinstance(out.run_id, str) and isinstance(out.version, int) and isinstance(out.checksum, str)):
            raise ValueError(f"malformed digest: {data}")
        return out


def run_id(weights: Path) -> str:
    """The run's id (weights/RUN_ID), made on first use: a delta names the run of its base, so a
    server never rebuilds one run's delta on another run's version of the same number."""
    path = weights / RUN_ID
    if not path.exists():
        weights.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{RUN_ID}.tmp{os.getpid()}")
        tmp.write_text(uuid.uuid4().hex)
        os.replace(tmp, path)
    return path.read_text().strip()


def checksum(tensors: Mapping[str, torch.Tensor]) -> str:
    """xxh3-64 over every tensor in name order (name, dtype, shape, raw bytes): 16 hex digits.
    xxh3 runs at ~4.4 GB/s here against sha256's 0.56 (benchmarks/weight_update.py), and this
    guards against damage and mix-ups, not against an adversary who can write the run
    directory (who could write the weights themselves)."""
    import torch
    import xxhash

    h = xxhash.xxh3_64()
    for name in sorted(tensors):
        t = tensors[name].detach()
        h.update(f"{name}|{str(t.dtype).removeprefix('torch.')}|{list(t.shape)}|".encode())
        if t.numel():
            h.update(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


# --- the manifest -----------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    changed: int


@dataclass(frozen=True)
class Manifest:
    run_id: str
    version: int
    base_version: int
    base_checksum: str
    checksum: str
    """Of the rebuilt version: what the full file of this version would hold."""
    tensors: dict[str, TensorEntry]

    @property
    def changed(self) -> int:
        return sum(e.changed for e in self.tensors.values())

    @property
    def base(self) -> Digest:
        return Digest(self.run_id, self.base_version, self.base_checksum)

    def to_json(self) -> bytes:
        return json.dumps({
            "format": FORMAT, "run_id": self.run_id, "version": self.version,
            "base": {"version": self.base_version, "checksum": self.base_checksum}, "checksum": self.checksum,
            "tensors": {n: {"dtype": e.dtype, "shape": list(e.shape), "changed": e.changed}
                        for n, e in self.tensors.items()},
        }, indent=1).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> Manifest:
        """Parse and check; a malformed manifest is a ValueError naming the field."""
        data = json.loads(raw)
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} manifest")
        base = data.get("base") or {}
        fields = (data.get("run_id"), data.get("version"), base.get("version"), base.get("checksum"),
                  data.get("checksum"))
        if not (isinstance(fields[0], str) and isinstance(fields[1], int) and isinstance(fields[2], int)
                and isinstance(fields[3], str) and isinstance(fields[4], str)):
            raise ValueError("run_id, version, base.version, base.checksum and checksum must all be set")
        if fields[2] >= fields[1]:
            raise ValueError(f"base version {fields[2]} is not before version {fields[1]}")
        tensors = {}
        for name, e in (data.get("tensors") or {}).items():
            shape, changed = tuple(e.get("shape", ())), e.get("changed")
            if e.get("dtype") not in _dtype_widths() or not all(isinstance(x, int) and x >= 0 for x in shape):
                raise ValueError(f"tensor {name}: bad dtype or shape")
            numel = 1
            for x in shape:
                numel *= x
            if not isinstance(changed, int) or not 0 <= changed <= numel:
                raise ValueError(f"tensor {name}: changed {changed!r} outside 0..{numel}")
            tensors[name] = TensorEntry(e["dtype"], shape, changed)
        return cls(*fields, tensors)


def read_manifest(directory: Path | str) -> Manifest:
    return Manifest.from_json((Path(directory) / MANIFEST).read_bytes())


def base_dir(directory: Path | str, manifest: Manifest) -> Path:
    """Where the delta's base lives: its sibling step_<base> (the same weights/ directory)."""
    return Path(directory).parent / f"step_{manifest.base_version}"


def _dtype_widths() -> dict[str, int]:
    return {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
            "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}


# --- encoding and rebuilding ------------------------------------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns, flat, as integers of its width: equal exactly when the bytes are."""
    import torch

    return t.detach().reshape(-1).view(getattr(torch, _INT_OF_WIDTH[t.element_size()]))


def encode(base: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]
           ) -> tuple[dict[str, TensorEntry], dict[str, torch.Tensor]]:
    """The delta from `base` to `new` (the same names, dtypes and shapes): every tensor's entry,
    and for each that changed "<name>/idx" and "<name>/val"."""
    import numpy as np
    import torch

    if base.keys() != new.keys():
        raise ValueError(f"base and new differ in tensors: {sorted(base.keys() ^ new.keys())[:5]}")
    entries, changes = {}, {}
    for name, t in new.items():
        b = base[name]
        if b.dtype != t.dtype or b.shape != t.shape:
            raise ValueError(f"{name}: base {b.dtype} {tuple(b.shape)}, new {t.dtype} {tuple(t.shape)}")
        flat = t.detach().reshape(-1)
        # numpy's compare + flatnonzero: half the CPU time of torch's ne + nonzero here (0.28 vs
        # 0.54 s for a 0.5B model's embedding); the gathered tensors are on the CPU already.
        idx = torch.from_numpy(np.flatnonzero(_bits(b).cpu().numpy() != _bits(t).cpu().numpy()))
        entries[name] = TensorEntry(str(t.dtype).removeprefix("torch."), tuple(t.shape), idx.numel())
        if idx.numel():
            values = flat[idx]
            changes[f"{name}/idx"] = idx.to(torch.int32) if flat.numel() < 2**31 else idx
            changes[f"{name}/val"] = values
    return entries, changes


@contextmanager
def patched(base: dict[str, torch.Tensor], manifest: Manifest, changes: Mapping[str, torch.Tensor]):
    """Within the block, `base` holds version manifest.version: the changed values are written
    into its tensors in place, and the old ones put back when the block ends, however it ends.
    In place, not into a copy: a copy of every changed tensor is a copy of nearly the whole model
    (nearly every tensor has some change), 0.2-0.3 s a GB here. The block must not keep the
    tensors (vLLM's loader copies them into its own parameters). DeltaRefused when the pieces
    do not fit (nothing changed then)."""
    undo: list = []
    try:
        _apply(base, manifest, changes, undo)
        yield base
    finally:
        for flat, idx, old in reversed(undo):
            flat.index_put_((idx,), old)


def rebuild(base: Mapping[str, torch.Tensor], manifest: Manifest, changes: Mapping[str, torch.Tensor]
            ) -> dict[str, torch.Tensor]:
    """Version manifest.version from its base and changes, as new tensors (the base untouched;
    tensors that did not change are the base's own). DeltaRefused when the pieces do not fit."""
    _check_fits(base, manifest, changes)
    out = {n: base[n].detach().clone() if e.changed else base[n] for n, e in manifest.tensors.items()}
    _apply(out, manifest, changes, None)
    return out


def _apply(tensors: Mapping[str, torch.Tensor], manifest: Manifest, changes: Mapping[str, torch.Tensor],
           undo: list | None) -> None:
    """Write the changed values into `tensors` in place; with `undo`, record the old ones first."""
    import torch

    _check_fits(tensors, manifest, changes)
    for name, entry in manifest.tensors.items():
        if not entry.changed:
            continue
        flat = tensors[name].detach().view(-1)
        idx = changes[f"{name}/idx"].to(device=flat.device, dtype=torch.int64)
        try:
            # The gather checks the indices before anything is written (no min/max pass: it
            # cost more than the writes); a negative index wraps around, as in Python, and a
            # version built so fails its checksum.
            old = flat[idx]
        except (IndexError, RuntimeError):
            raise DeltaRefused(f"{name}: the delta's indices fall outside its {flat.numel()} values") from None
        if undo is not None:
            undo.append((flat, idx, old))
        flat.index_put_((idx,), changes[f"{name}/val"].to(flat.device))


def _check_fits(base: Mapping[str, torch.Tensor], manifest: Manifest, changes: Mapping[str, torch.Tensor]) -> None:
    if base.keys() != manifest.tensors.keys():
        raise DeltaRefused(f"version {manifest.version}'s tensors are not those of its base version "
                           f"{manifest.base_version}: {sorted(base.keys() ^ manifest.tensors.keys())[:3]}")
    for name, entry in manifest.tensors.items():
        b = base[name]
        if str(b.dtype).removeprefix("torch.") != entry.dtype or tuple(b.shape) != entry.shape:
            raise DeltaRefused(f"{name}: the base holds {b.dtype} {tuple(b.shape)}, the delta {entry.dtype} "
                               f"{list(entry.shape)}")
        if not entry.changed:
            continue
        idx, val = changes.get(f"{name}/idx"), changes.get(f"{name}/val")
        if (idx is None or val is None or idx.dim() != 1 or idx.numel() != entry.changed
                or val.numel() != entry.changed or val.dtype != b.dtype or idx.is_floating_point()):
            raise DeltaRefused(f"{name}: the delta's changes do not match its manifest ({entry.changed} values)")
