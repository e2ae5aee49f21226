"""The batch wire format between orchestrator and trainer (never pickle).

A batch is a directory rollouts/step_<n>/ holding
  batch.safetensors  flat tensors: every sample's prompt+completion tokens back to back
  meta.json          step, sample count, temperature, and the sha256 of batch.safetensors

Per sample: `tokens` (prompt then completion), `loss_mask` (1 on completion tokens),
`logprobs` (the inference engine's logprob of each completion token, 0 elsewhere), and
`lengths`, `advantages`, `rewards`, `versions` (the policy version that generated it).
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from rl.rundir import publish_dir

FORMAT = "asyncrl.batch.v1"


class BatchError(Exception):
    """A batch that is missing, truncated or fails its checksum; the message names the file."""


@dataclass
class Sample:
    prompt_ids: list[int]
    completion_ids: list[int]
    completion_logprobs: list[float]
    advantage: float
    reward: float
    version: int


@dataclass
class Batch:
    step: int
    temperature: float
    tokens: np.ndarray  # int64 [total_tokens]
    loss_mask: np.ndarray  # uint8 [total_tokens]
    logprobs: np.ndarray  # float32 [total_tokens]
    lengths: np.ndarray  # int64 [num_samples]
    advantages: np.ndarray  # float32 [num_samples]
    rewards: np.ndarray  # float32 [num_samples]
    versions: np.ndarray  # int64 [num_samples]

    @property
    def num_samples(self) -> int:
        return len(self.lengths)

    @classmethod
    def from_samples(cls, step: int, temperature: float, samples: list[Sample]) -> Batch:
        tokens, mask, logprobs = [], [], []
        for s in samples:
            assert len(s.completion_ids) == len(s.completion_logprobs)
            tokens += s.prompt_ids + s.completion_ids
            mask += [0] * len(s.prompt_ids) + [1] * len(s.completion_ids)
            logprobs += [0.0] * len(s.prompt_ids) + list(s.completion_logprobs)
        return cls(
            step=step,
            temperature=temperature,
            tokens=np.asarray(tokens, dtype=np.int64),
            loss_mask=np.asarray(mask, dtype=np.uint8),
            logprobs=np.asarray(logprobs, dtype=np.float32),
            lengths=np.asarray([len(s.prompt_ids) + len(s.completion_ids) for s in samples], dtype=np.int64),
            advantages=np.asarray([s.advantage for s in samples], dtype=np.float32),
            rewards=np.asarray([s.reward for s in samples], dtype=np.float32),
            versions=np.asarray([s.version for s in samples], dtype=np.int64),
        )

    def sample_slices(self) -> list[slice]:
        ends = np.cumsum(self.lengths)
        return [slice(int(e - n), int(e)) for e, n in zip(ends, self.lengths)]

    _TENSORS = ("tokens", "loss_mask", "logprobs", "lengths", "advantages", "rewards", "versions")

    def to_bytes(self) -> bytes:
        return st_save({k: getattr(self, k) for k in self._TENSORS}, metadata={"format": FORMAT})

    def write(self, final: Path) -> None:
        """Write batch `step` to `final` atomically (temporary directory, then one rename)."""
        payload = self.to_bytes()
        meta = {
            "format": FORMAT,
            "step": self.step,
            "num_samples": self.num_samples,
            "temperature": self.temperature,
            "sha256": hashlib.sha256(payload).hexdigest(),
        }
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
        # Plain writes: nobody reads the temporary directory, and publish_dir fsyncs every file
        # once before the rename that makes the batch visible.
        (tmp / "batch.safetensors").write_bytes(payload)
        (tmp / "meta.json").write_text(json.dumps(meta))
        publish_dir(tmp, final)

    @classmethod
    def read(cls, directory: Path) -> Batch:
        meta_path, data_path = directory / "meta.json", directory / "batch.safetensors"
        try:
            meta = json.loads(meta_path.read_text())
            payload = data_path.read_bytes()
        except FileNotFoundError as e:
            raise BatchError(f"incomplete batch: {e.filename} is missing") from None
        except json.JSONDecodeError as e:
            raise BatchError(f"{meta_path}: not valid JSON ({e})") from None
        if meta.get("format") != FORMAT:
            raise BatchError(f"{meta_path}: format {meta.get('format')!r}, expected {FORMAT!r}")
        if hashlib.sha256(payload).hexdigest() != meta.get("sha256"):
            raise BatchError(f"{data_path}: checksum mismatch (truncated or corrupted)")
        arrays = st_load(payload)
        missing = [k for k in cls._TENSORS if k not in arrays]
        if missing:
            raise BatchError(f"{data_path}: missing tensors {missing}")
        batch = cls(step=int(meta["step"]), temperature=float(meta["temperature"]), **{k: arrays[k] for k in cls._TENSORS})
        if int(batch.lengths.sum()) != len(batch.tokens):
            raise BatchError(f"{data_path}: lengths do not add up to the token count")
        return batch
