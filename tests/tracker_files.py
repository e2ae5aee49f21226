"""What a run's trackers wrote, read back with their own readers (TensorBoard's event reader):
shared by the tracking, SFT and chat end-to-end tests."""

from __future__ import annotations

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util.tensor_util import make_ndarray


def scalars(directory) -> dict[str, list[tuple[int, float]]]:
    """What TensorBoard's own reader finds (its summary API stores scalars as tensors), all of it:
    by default the reader keeps a random 10 points per tag."""
    acc = EventAccumulator(str(directory), size_guidance={"tensors": 0})
    acc.Reload()
    return {tag: [(e.step, float(make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]
            for tag in acc.Tags()["tensors"]}
