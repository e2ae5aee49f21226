"""Which versions the trainer publishes whole and which as deltas (`[weight_sync] delta`), and
the last full version every delta is taken against (rl/weights/delta.py has the format).

    FullVersions   delta = false: every version whole, no digest (what asyncrl always did)
    Deltas         delta = true: a full version first (after a restart too: the base of a delta
                   must be a version this trainer holds in memory, and a server that restarted
                   with it catches up through its files), then every full_every versions; the
                   versions between are deltas against it

Rank 0 only. Deltas keeps a copy of the base's tensors (served dtype, on CPU): one more copy of
the weights in host memory, which is what makes a delta a comparison and not a read.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from rl.weights import delta as wd
from rl.config import RunConfig
from rl.rundir import RunDir

log = logging.getLogger("trainer")


@dataclass
class Delta:
    """Version `manifest.version` as its changes against a full version."""

    manifest: wd.Manifest
    changes: dict[str, torch.Tensor]
    encode_s: float

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.changes.values())


class FullVersions:
    """delta = false."""

    def delta(self, step: int, tensors: dict[str, torch.Tensor]) -> Delta | None:
        """Version `step` as a delta, or None: publish it whole (then call published_full)."""
        return None

    def digest(self, step: int, tensors: dict[str, torch.Tensor]) -> wd.Digest | None:
        """The digest a full version's directory carries (None: none)."""
        return None

    def published_full(self, step: int, tensors: dict[str, torch.Tensor], digest: wd.Digest | None) -> None:
        """Version `step` went out whole: later deltas may be taken against it."""


class Deltas(FullVersions):
    def __init__(self, run: RunDir, full_every: int):
        self.run_id = wd.run_id(run.weights)
        self.full_every = full_every
        self.base: dict[str, torch.Tensor] | None = None
        self.base_digest: wd.Digest | None = None

    def delta(self, step: int, tensors: dict[str, torch.Tensor]) -> Delta | None:
        b = self.base_digest
        if self.base is None or step - b.version >= self.full_every or step <= b.version:
            return None
        start = time.perf_counter()
        entries, changes = wd.encode(self.base, tensors)
        # The checksum of the whole result, which the server's rebuild must reproduce.
        manifest = wd.Manifest(self.run_id, step, b.version, b.checksum, wd.checksum(tensors), entries)
        return Delta(manifest, changes, time.perf_counter() - start)

    def digest(self, step: int, tensors: dict[str, torch.Tensor]) -> wd.Digest:
        return wd.Digest(self.run_id, step, wd.checksum(tensors))

    def published_full(self, step: int, tensors: dict[str, torch.Tensor], digest: wd.Digest | None) -> None:
        # A copy: gathered without a cast, a tensor may share storage with the live parameter
        # that the next optimizer step changes in place. Once per full_every versions.
        self.base = {k: v.detach().clone() for k, v in tensors.items()}
        self.base_digest = digest


def make_versions(cfg: RunConfig, run: RunDir) -> FullVersions:
    ws = cfg.weight_sync
    return Deltas(run, ws.full_every) if ws.delta else FullVersions()
