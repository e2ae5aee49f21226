"""The batch wire format between orchestrator and trainer (never pickle).

A batch is two blobs, the same over either transport (rl/transport/interface.py):
  meta.json          step, sample count, and the sha256 of the tensors
  batch.safetensors  flat tensors: every sample's tokens back to back

Per token: `tokens` (prompt, then model and environment turns), `loss_mask` (1 on tokens the
model sampled), `logprobs` (the inference engine's logprob of each sampled token, 0 elsewhere),
`advantages` (per token: a group-relative reward is spread over the sample's tokens, a teacher's
reverse KL differs token by token), `token_versions` (the policy version that sampled each token,
-1 on tokens the model did not sample). Per sample: `lengths`, `rewards`, and `versions`, the
OLDEST version among its tokens: the staleness bound is a statement about the oldest token.

Sampling settings are per sample too (`temperatures`, `top_p`, `top_k`, `min_p`), because one
batch may mix datasets that each sample their own way. The trainer recomputes each token's
logprob under its own sample's temperature (the distribution the engine sampled from); top_p,
top_k and min_p are what rebuilds the sampler's kept set (trainer/sampling_mask.py: vLLM's
truncation replayed on the trainer's logits, checked against the sampler's own sets in
tests/trainer/test_sampling_mask.py), so the sampling mask costs no bytes beyond these 16 per sample.
top_k -1 (or 0, as vLLM accepts too) is off.

Replayed kept sets (orchestrator.sampling.record_kept_sets): `kept_counts` per token (how many ids the
sampler kept when it drew that token, 0 where none was recorded: prompt and environment tokens,
or a set too large to record) and `kept_ids`, those ids back to back (sum(kept_counts) of them).

Routed experts (inference.record_routing, for trainer.mismatch.routing_replay): `routing_shape` (layers,
top_k), empty when the batch carries none; then per token `routed` (1 where the engine's routing
of that position was recorded) and `routed_experts`, each token's [layers, top_k] expert ids
(uint8: vLLM's own record is uint8 up to 256 experts), zeros where not routed. Prompt tokens have
rows too: routing replay needs every position the model attends over.

Images (a vision-language policy: docs/vlm.md): per sample `image_counts` (how many images its
prompt holds, in the order of its placeholders), per image `image_sizes` (bytes), and
`image_bytes`, the images' PNG files back to back. The trainer re-processes them with the
model's own image processor (trainer/vision.py): PNG is lossless, so it sees the pixels the
server saw, in a fraction of the processed pixels' bytes. A batch without images carries the
three empty; a batch written before images existed lacks them and decodes as one without.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from rl.faults import crash_point
from rl.rundir import publish_dir

FORMAT = "asyncrl.batch.v5"


class BatchError(Exception):
    """A batch that is missing, truncated or fails its checksum; the message names the source."""


@dataclass
class Sample:
    """One trajectory: a prompt and one or more model turns (with environment turns between)."""

    tokens: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    advantages: list[float]
    versions: list[int]
    reward: float
    # What the engine sampled it with (vLLM's conventions: top_k -1 is off).
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    # The sampler's kept set per token (rl/batch.py module docstring); empty: none recorded.
    kept_counts: list[int] = dataclasses.field(default_factory=list)
    kept_ids: list[int] = dataclasses.field(default_factory=list)
    # The engine's routed experts per token, uint8 [tokens, layers, top_k], and which tokens have a
    # record (1) (rl/batch.py module docstring); None: none recorded.
    routed_experts: np.ndarray | None = None
    routed: np.ndarray | None = None
    # The prompt's images as PNG bytes, in the order of its image placeholders (rl/batch.py
    # module docstring); empty for a text sample.
    images: list[bytes] = dataclasses.field(default_factory=list)

    @functools.cached_property
    def oldest_version(self) -> int:
        """Oldest version among the sampled tokens (a sample with none is as new as can be).
        Sampled tokens are those with a version, trained on or not (orchestrator.overlong.mode = "mask"
        keeps a cut completion out of the loss, not out of the staleness bound)."""
        return min((v for v in self.versions if v >= 0), default=1 << 62)

    @property
    def num_model_tokens(self) -> int:
        return sum(self.loss_mask)


def routing_arrays(samples: list[Sample]) -> dict[str, np.ndarray]:
    """Batch.routing_shape / routed / routed_experts from the samples' records: zeros and not
    routed for a sample with none; all records of one batch have one [layers, top_k]."""
    shapes = {s.routed_experts.shape[1:] for s in samples if s.routed_experts is not None}
    if not shapes:
        return {"routing_shape": np.zeros(0, np.int64), "routed": np.zeros(0, np.uint8),
                "routed_experts": np.zeros(0, np.uint8)}
    if len(shapes) > 1:
        raise ValueError(f"samples' routed experts differ in [layers, top_k]: {sorted(shapes)}")
    shape = shapes.pop()
    experts, routed = [], []
    for i, s in enumerate(samples):
        n = len(s.tokens)
        if s.routed_experts is None:
            experts.append(np.zeros((n, *shape), np.uint8))
            routed.append(np.zeros(n, np.uint8))
        elif len(s.routed_experts) != n or s.routed is None or len(s.routed) != n:
            raise ValueError(f"sample {i}: routed experts for {len(s.routed_experts)} positions, "
                             f"it has {n} tokens")
        else:
            experts.append(s.routed_experts.astype(np.uint8, copy=False))
            routed.append(np.asarray(s.routed, np.uint8))
    return {"routing_shape": np.asarray(shape, np.int64), "routed": np.concatenate(routed),
            "routed_experts": np.concatenate(experts).reshape(-1)}


def image_arrays(samples: list[Sample]) -> dict[str, np.ndarray]:
    """Batch.image_counts / image_sizes / image_bytes; all empty when no sample has an image."""
    if not any(s.images for s in samples):
        return {}
    images = [im for s in samples for im in s.images]
    return {"image_counts": np.asarray([len(s.images) for s in samples], np.int64),
            "image_sizes": np.asarray([len(im) for im in images], np.int64),
            "image_bytes": np.frombuffer(b"".join(images), np.uint8).copy()}


@dataclass
class Batch:
    step: int
    tokens: np.ndarray  # int64 [total_tokens]
    loss_mask: np.ndarray  # uint8 [total_tokens]
    logprobs: np.ndarray  # float32 [total_tokens]
    advantages: np.ndarray  # float32 [total_tokens]
    token_versions: np.ndarray  # int64 [total_tokens]
    lengths: np.ndarray  # int64 [num_samples]
    rewards: np.ndarray  # float32 [num_samples]
    versions: np.ndarray  # int64 [num_samples], oldest token version
    temperatures: np.ndarray  # float32 [num_samples]
    top_p: np.ndarray  # float32 [num_samples]
    top_k: np.ndarray  # int64 [num_samples]
    min_p: np.ndarray  # float32 [num_samples]
    kept_counts: np.ndarray  # int32 [total_tokens]
    kept_ids: np.ndarray  # int32 [sum(kept_counts)]
    # int64 [2]: (layers, top_k), [] when no routing is carried; then uint8 [total_tokens] and
    # uint8 [total_tokens * layers * top_k] (flat), else both [].
    routing_shape: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))
    routed: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.uint8))
    routed_experts: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.uint8))
    # int64 [num_samples], int64 [num_images], uint8 [sum(image_sizes)]: see the module docstring.
    image_counts: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))
    image_sizes: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))
    image_bytes: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.uint8))

    @property
    def num_samples(self) -> int:
        return len(self.lengths)

    @classmethod
    def from_samples(cls, step: int, samples: list[Sample]) -> Batch:
        for i, s in enumerate(samples):
            n = len(s.tokens)
            if not len(s.loss_mask) == len(s.logprobs) == len(s.advantages) == len(s.versions) == n:
                raise ValueError(f"sample {i}: per-token fields differ in length from its {n} tokens")
            if s.kept_counts and (len(s.kept_counts) != n or sum(s.kept_counts) != len(s.kept_ids)):
                raise ValueError(f"sample {i}: kept_counts ({len(s.kept_counts)} values, sum {sum(s.kept_counts)}) "
                                 f"do not match its {n} tokens and {len(s.kept_ids)} kept ids")

        def cat(field: str, dtype) -> np.ndarray:
            return np.asarray([x for s in samples for x in getattr(s, field)], dtype=dtype)

        def each(field: str, dtype) -> np.ndarray:
            return np.asarray([getattr(s, field) for s in samples], dtype=dtype)

        batch = cls(
            step=step,
            tokens=cat("tokens", np.int64),
            loss_mask=cat("loss_mask", np.uint8),
            logprobs=cat("logprobs", np.float32),
            advantages=cat("advantages", np.float32),
            token_versions=cat("versions", np.int64),
            lengths=np.asarray([len(s.tokens) for s in samples], dtype=np.int64),
            rewards=np.asarray([s.reward for s in samples], dtype=np.float32),
            versions=np.asarray([s.oldest_version for s in samples], dtype=np.int64),
            temperatures=each("temperature", np.float32),
            top_p=each("top_p", np.float32),
            top_k=each("top_k", np.int64),
            min_p=each("min_p", np.float32),
            kept_counts=np.asarray([c for s in samples for c in (s.kept_counts or [0] * len(s.tokens))],
                                   dtype=np.int32),
            kept_ids=cat("kept_ids", np.int32),
            **routing_arrays(samples),
            **image_arrays(samples),
        )
        # Refused here, where the culprit is known, rather than by the trainer that decodes it.
        if problem := batch.sampling_problem():
            raise ValueError(problem)
        return batch

    def routing(self) -> np.ndarray | None:
        """The routed experts as uint8 [total_tokens, layers, top_k], or None when not carried."""
        if not len(self.routing_shape):
            return None
        return self.routed_experts.reshape(len(self.tokens), *self.routing_shape.tolist())

    @functools.cached_property
    def _image_starts(self) -> tuple[np.ndarray, np.ndarray]:
        """(first image of each sample, first byte of each image)."""
        return (np.cumsum(self.image_counts) - self.image_counts, np.cumsum(self.image_sizes) - self.image_sizes)

    def sample_images(self, i: int) -> list[bytes]:
        """Sample i's images (PNG bytes), in the order of its placeholders."""
        if not len(self.image_counts) or not self.image_counts[i]:
            return []
        first, offsets = self._image_starts
        k = int(first[i])
        return [self.image_bytes[int(offsets[j]):int(offsets[j] + self.image_sizes[j])].tobytes()
                for j in range(k, k + int(self.image_counts[i]))]

    @property
    def has_images(self) -> bool:
        return bool(len(self.image_counts)) and bool(self.image_counts.any())

    def sample_slices(self) -> list[slice]:
        ends = np.cumsum(self.lengths)
        return [slice(int(e - n), int(e)) for e, n in zip(ends, self.lengths)]

    # name -> (dtype, one value per "token" or per "sample")
    _SCHEMA = {"tokens": (np.int64, "token"), "loss_mask": (np.uint8, "token"), "logprobs": (np.float32, "token"),
               "advantages": (np.float32, "token"), "token_versions": (np.int64, "token"),
               "lengths": (np.int64, "sample"), "rewards": (np.float32, "sample"), "versions": (np.int64, "sample"),
               "temperatures": (np.float32, "sample"), "top_p": (np.float32, "sample"), "top_k": (np.int64, "sample"),
               "min_p": (np.float32, "sample"), "kept_counts": (np.int32, "token"), "kept_ids": (np.int32, "kept"),
               "routing_shape": (np.int64, "routing_shape"), "routed": (np.uint8, "routed"),
               "routed_experts": (np.uint8, "routing"), "image_counts": (np.int64, "image_counts"),
               "image_sizes": (np.int64, "image_sizes"), "image_bytes": (np.uint8, "image_bytes")}
    _TENSORS = tuple(_SCHEMA)
    # Absent from a batch written before images were carried: decoded as empty.
    _OPTIONAL = ("image_counts", "image_sizes", "image_bytes")

    # --- encoding: the same two blobs on disk and on the wire ---------------------------------

    def encode(self) -> tuple[bytes, bytes]:
        """(meta JSON, safetensors payload)."""
        payload = st_save({k: getattr(self, k) for k in self._TENSORS}, metadata={"format": FORMAT})
        meta = {
            "format": FORMAT,
            "step": self.step,
            "num_samples": self.num_samples,
            "sha256": hashlib.sha256(payload).hexdigest(),
        }
        return json.dumps(meta).encode(), payload

    @classmethod
    def decode(cls, meta_bytes: bytes, payload: bytes, source: str, meta_source: str | None = None) -> Batch:
        """Inverse of encode; `source` (the payload's file, a socket address) and `meta_source`
        (the meta's, if elsewhere) name the culprit in errors."""
        meta_source = meta_source or source
        try:
            meta = json.loads(meta_bytes)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BatchError(f"{meta_source}: not valid JSON ({e})") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
            raise BatchError(f"{meta_source}: format {got!r}, expected {FORMAT!r}")
        if hashlib.sha256(payload).hexdigest() != meta.get("sha256"):
            raise BatchError(f"{source}: checksum mismatch (truncated or corrupted)")
        step = meta.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or step < 1:
            raise BatchError(f"{meta_source}: step {step!r} is not a positive integer")
        try:
            arrays = st_load(payload)
        except Exception as e:  # safetensors raises its own error types on a bad header
            raise BatchError(f"{source}: not a safetensors payload ({e})") from None
        for name, (dtype, per) in cls._SCHEMA.items():
            if name not in arrays and name in cls._OPTIONAL:
                arrays[name] = np.zeros(0, dtype)
            if name not in arrays:
                raise BatchError(f"{source}: tensor {name!r} is missing")
            a = arrays[name]
            if a.dtype != dtype or a.ndim != 1:
                raise BatchError(f"{source}: tensor {name!r} is {a.dtype}{list(a.shape)}, expected 1-D {dtype}")
        batch = cls(step=step, **{k: arrays[k] for k in cls._TENSORS})
        batch.validate(source, meta.get("num_samples"))
        return batch

    def validate(self, source: str, num_samples: object = None) -> None:
        """What the trainer relies on beyond the checksum (which proves only that the bytes are
        the ones written): consistent shapes, and no value that would poison a step."""
        n, t = self.num_samples, len(self.tokens)
        if num_samples is not None and num_samples != n:
            raise BatchError(f"{source}: {n} samples, but meta.json says {num_samples}")
        if n == 0:
            raise BatchError(f"{source}: no samples")
        if len(self.routing_shape) not in (0, 2) or (self.routing_shape < 1).any():
            raise BatchError(f"{source}: tensor 'routing_shape' is {self.routing_shape.tolist()}, expected "
                             f"[layers, top_k] or nothing")
        width = int(np.prod(self.routing_shape)) if len(self.routing_shape) else 0
        for name, (_, per) in self._SCHEMA.items():
            images = len(self.image_counts) > 0
            want = {"token": t, "sample": n, "kept": int(self.kept_counts.sum(dtype=np.int64)),
                    "routing_shape": len(self.routing_shape), "routed": t if width else 0,
                    "routing": t * width, "image_counts": n if images else 0,
                    "image_sizes": int(self.image_counts.sum()) if images else 0,
                    "image_bytes": int(self.image_sizes.sum()) if images else 0}[per]
            if len(getattr(self, name)) != want:
                raise BatchError(f"{source}: tensor {name!r} has {len(getattr(self, name))} values, expected {want}")
        if (self.lengths < 1).any() or int(self.lengths.sum()) != t:
            raise BatchError(f"{source}: lengths do not add up to the token count")
        if (self.tokens < 0).any():
            raise BatchError(f"{source}: negative token ids")
        if (self.image_counts < 0).any() or (self.image_sizes < 1).any():
            raise BatchError(f"{source}: negative image_counts or an empty image")
        if (self.kept_counts < 0).any() or (self.kept_ids < 0).any():
            raise BatchError(f"{source}: negative kept_counts or kept_ids")
        if not set(np.unique(self.loss_mask).tolist()) <= {0, 1}:
            raise BatchError(f"{source}: loss_mask holds values other than 0 and 1")
        for name in ("logprobs", "advantages", "rewards"):
            if not np.isfinite(getattr(self, name)).all():
                raise BatchError(f"{source}: tensor {name!r} holds NaN or infinity")
        if problem := self.sampling_problem():
            raise BatchError(f"{source}: {problem}")

    def sampling_problem(self) -> str | None:
        """The first sample whose sampling settings are out of range, or None. A temperature
        of 0 or NaN would make the trainer's logits (logits / temperature) inf or NaN."""
        # Written so that NaN fails every check (every comparison with NaN is false).
        checks = (("temperatures", (self.temperatures > 0) & np.isfinite(self.temperatures), "finite and > 0"),
                  ("top_p", (self.top_p > 0) & (self.top_p <= 1), "in (0, 1]"),
                  ("top_k", self.top_k >= -1, "-1 (off), 0 (off) or >= 1"),
                  ("min_p", (self.min_p >= 0) & (self.min_p <= 1), "in [0, 1]"))
        for name, ok, want in checks:
            if not ok.all():
                i = int(np.flatnonzero(~ok)[0])
                return f"tensor {name!r} holds {getattr(self, name)[i].item()!r} for sample {i}, expected {want}"
        return None

    @staticmethod
    def write_encoded(meta: bytes, payload: bytes, final: Path) -> None:
        """Write a batch's encoded blobs (Batch.encode, or as received over ZMQ) to directory
        `final` atomically (a temporary directory, then one rename)."""
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
        # Plain writes: nobody reads the temporary directory, and publish_dir fsyncs every file
        # once before the rename that makes the batch visible.
        (tmp / "batch.safetensors").write_bytes(payload)
        (tmp / "meta.json").write_bytes(meta)
        crash_point("batch.staged", int(final.name.removeprefix("step_")) if final.name.startswith("step_") else 0)
        publish_dir(tmp, final)

    @staticmethod
    def read_encoded(directory: Path) -> tuple[bytes, bytes]:
        """The (meta, payload) blobs of a batch directory, undecoded."""
        try:
            return (directory / "meta.json").read_bytes(), (directory / "batch.safetensors").read_bytes()
        except FileNotFoundError as e:
            raise BatchError(f"incomplete batch: {e.filename} is missing") from None

    @classmethod
    def read(cls, directory: Path) -> Batch:
        return cls.read_checked(directory)[0]

    @classmethod
    def read_checked(cls, directory: Path) -> tuple[Batch, bytes, bytes]:
        """The batch of a directory and its (meta, payload) blobs as read."""
        meta, payload = cls.read_encoded(directory)
        return cls.decode(meta, payload, str(directory / "batch.safetensors"), str(directory / "meta.json")), meta, payload
