"""The workers' side of weight deltas (rl/weights/delta.py): the full version a worker keeps as
its base, and a version rebuilt from it, checked against its checksum before anything is loaded.
staging.py calls these; every refusal (DeltaRefused) comes before any worker touches the engine.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


def raise_refused(why: str):
    """A delta (or base) this worker will not load; raised before the engine is touched."""
    from rl.weights import delta as wd

    raise wd.DeltaRefused(why)


@dataclass
class BaseVersion:
    """A full version kept in host memory (its checkpoint-named tensors, as in the file): the
    CPU backend packs linear weights and empties `.weight`, and vLLM fuses q/k/v and gate/up,
    so the served parameters cannot give the checkpoint's tensors back; this copy can."""

    digest: object  # weight_delta.Digest
    tensors: dict

    @classmethod
    def read(cls, path: str) -> BaseVersion:
        """Read a full version's safetensors and check them against its digest.json (refused,
        one line, when they are missing, damaged or no such version)."""
        from safetensors.torch import load_file

        from rl.weights import delta as wd

        directory = Path(path)
        try:
            digest = wd.Digest.read(directory)
            files = sorted(f for f in directory.glob("*.safetensors") if f.name != wd.TENSORS)
            if not files:
                raise FileNotFoundError(f"{directory} holds no *.safetensors")
            tensors = {}
            for f in files:
                tensors.update(load_file(f))
        except Exception as e:  # OSError, a malformed digest, safetensors' SafetensorError
            raise_refused(f"the base at {directory} cannot be read: {type(e).__name__}: {str(e)[:300]}")
        got = wd.checksum(tensors)
        if got != digest.checksum:
            raise_refused(f"the base at {directory} is damaged: its tensors' checksum is {got}, its digest "
                          f"says {digest.checksum}")
        return cls(digest, tensors)


@contextmanager
def rebuilt(base: BaseVersion, manifest, changes: dict):
    """Within the block, the base's tensors hold the version, checked against its checksum
    (refused when they differ): yields (tensors, the checksum this worker computed of them). The
    base's own values are back after it (weight_delta.patched)."""
    from rl.weights import delta as wd

    with wd.patched(base.tensors, manifest, changes) as tensors:
        got = wd.checksum(tensors)
        if got != manifest.checksum:
            raise_refused(f"version {manifest.version} rebuilt from version {manifest.base_version} has checksum "
                          f"{got}, its manifest says {manifest.checksum}")
        yield tensors, got
