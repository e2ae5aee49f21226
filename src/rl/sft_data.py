"""Supervised data, tokenized: what `rl sft`'s data step (orchestrator/sft/data.py) writes and its
trainer (trainer/sft.py) reads, in output_dir/sft_data/<split>.safetensors (never pickle).

Per token: `tokens` and `loss_mask` (1 on the assistant's tokens), every conversation's back to
back; per conversation: `lengths` and `dataset` (its index in `names`). The metadata holds the
datasets' names and weights, so that the trainer mixes them as the config says.

Image chats (docs/vlm.md) add, only when some conversation has images: each image's PNG bytes
back to back (`image_bytes`, uint8), each image's size (`image_sizes`) and each conversation's
count of images (`image_counts`), in the order of its placeholders: the bytes the trainer's
vision path (trainer/vision.py) re-processes, as it does for RL batches.

Which conversations batch n trains on is a pure function of the data, the seed and n
(`batch_rows`): a resumed run trains on exactly the batches the first one would have.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from rl.rundir import RunDir, fsync_dir


def sft_data_dir(run: RunDir) -> Path:
    return run.root / "sft_data"


@dataclass
class SftData:
    tokens: np.ndarray  # int64 [total_tokens]
    loss_mask: np.ndarray  # uint8 [total_tokens]
    lengths: np.ndarray  # int64 [conversations]
    dataset: np.ndarray  # int64 [conversations]: index into names
    names: list[str]
    weights: list[float]
    image_bytes: np.ndarray | None = None  # uint8 [all images' PNG bytes]
    image_sizes: np.ndarray | None = None  # int64 [images]
    image_counts: np.ndarray | None = None  # int64 [conversations]

    @property
    def num_rows(self) -> int:
        return len(self.lengths)

    def rows_of(self, d: int) -> np.ndarray:
        return np.flatnonzero(self.dataset == d)

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Conversation i's tokens and loss mask."""
        start = int(self.starts[i])
        end = start + int(self.lengths[i])
        return self.tokens[start:end], self.loss_mask[start:end]

    def images(self, i: int) -> list[bytes]:
        """Conversation i's images (PNG bytes), in the order of its placeholders."""
        if self.image_counts is None or not self.image_counts[i]:
            return []
        first = int(self.image_starts[i])
        ends = self.image_ends[first:first + int(self.image_counts[i])]
        return [self.image_bytes[e - n:e].tobytes() for e, n in zip(ends, self.image_sizes[first:first + len(ends)])]

    @functools.cached_property
    def image_starts(self) -> np.ndarray:
        return np.cumsum(self.image_counts) - self.image_counts

    @functools.cached_property
    def image_ends(self) -> np.ndarray:
        return np.cumsum(self.image_sizes)

    @functools.cached_property
    def starts(self) -> np.ndarray:
        """Where each conversation begins in `tokens` (once: row() is on every step's path)."""
        return np.cumsum(self.lengths) - self.lengths

    def write(self, path: Path) -> None:
        """One file, renamed into place whole."""
        meta = {"format": "asyncrl.sft.v1", "names": json.dumps(self.names), "weights": json.dumps(self.weights)}
        tmp = path.with_name(f".{path.name}.tmp")
        arrays = {"tokens": self.tokens, "loss_mask": self.loss_mask, "lengths": self.lengths, "dataset": self.dataset}
        if self.image_counts is not None and self.image_counts.any():
            arrays.update(image_bytes=self.image_bytes, image_sizes=self.image_sizes, image_counts=self.image_counts)
        save_file(arrays, str(tmp), metadata=meta)
        tmp.replace(path)
        fsync_dir(path.parent)

    @classmethod
    def read(cls, path: Path) -> SftData:
        from safetensors import safe_open

        with safe_open(str(path), "np") as f:
            meta = f.metadata() or {}
        if meta.get("format") != "asyncrl.sft.v1":
            raise ValueError(f"{path}: not asyncrl supervised data (format {meta.get('format')!r})")
        t = load_file(str(path))
        return cls(t["tokens"], t["loss_mask"], t["lengths"], t["dataset"], json.loads(meta["names"]),
                   json.loads(meta["weights"]), t.get("image_bytes"), t.get("image_sizes"), t.get("image_counts"))


def batch_rows(data: SftData, seed: int, batch_size: int, step: int) -> list[int]:
    """The conversations of batch `step` (1-based): draws 0.. of one stream, batch n taking draws
    (n-1)*batch_size .. n*batch_size - 1. Each draw picks a dataset with probability proportional
    to its weight, then that dataset's next row; a dataset's rows are reshuffled for each pass
    (seeded by seed, dataset and pass), so every row is seen once per pass."""
    rng = np.random.default_rng([seed, 0])
    weights = np.asarray(data.weights, dtype=np.float64)
    weights = weights / weights.sum()
    per_dataset = [data.rows_of(d) for d in range(len(data.names))]
    first, last = (step - 1) * batch_size, step * batch_size
    # The draws before this batch only say where each dataset's pass stands (a count each): the
    # stream is regenerated, not stored, so there is nothing to checkpoint. (A prefix of the
    # draws is the same whatever `size` asks for: one uniform number per draw.) Numpy work in
    # step * batch_size: 16 ms at step 10,000 of 32.
    picks = rng.choice(len(per_dataset), size=last, p=weights)
    taken = np.bincount(picks[:first], minlength=len(per_dataset)).tolist()
    orders: dict[tuple[int, int], np.ndarray] = {}
    rows = []
    for d in picks[first:]:
        n = len(per_dataset[d])
        pass_, at = divmod(taken[d], n)
        taken[d] += 1
        if (d, pass_) not in orders:
            orders[d, pass_] = np.random.default_rng([seed, 1, int(d), pass_]).permutation(n)
        rows.append(int(per_dataset[d][orders[d, pass_][at]]))
    return rows
