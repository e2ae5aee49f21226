"""The prompt queue: the dataset stream plus prompts given back (by cancelled, failed or stale
groups), which go out again before any new row. Its state (how many rows were drawn, which
prompts are pending) is what the orchestrator checkpoints, so a resumed run neither skips nor
repeats data.
"""

from __future__ import annotations

import collections
import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Prompt:
    index: int
    """Position of the row in the seeded dataset stream: identifies it across requeues and resumes."""
    row: dict


class PromptQueue:
    def __init__(self, rows: Iterator[dict], cursor: int = 0, pending: list[Prompt] = ()):
        # Rows are re-generated from the seed, so skipping `cursor` rows lands where the run was.
        self.rows = itertools.islice(rows, cursor, None)
        self.cursor = cursor
        self.requeued: collections.deque[Prompt] = collections.deque(pending)

    def take(self) -> Prompt:
        if self.requeued:
            return self.requeued.popleft()
        try:
            row = next(self.rows)
        except StopIteration:
            raise RuntimeError(f"the dataset ran out after {self.cursor} rows "
                               "(orchestrator.dataset must yield enough rows for max_steps)") from None
        if not isinstance(row, dict):
            raise TypeError(f"orchestrator.dataset: row {self.cursor} is a {type(row).__name__}, not a dict")
        prompt = Prompt(self.cursor, row)
        self.cursor += 1
        return prompt

    def give_back(self, prompt: Prompt) -> None:
        self.requeued.append(prompt)


def encode_state(step: int, cursor: int, pending: list[Prompt]) -> bytes:
    """The orchestrator's checkpoint: batches 1..step are handed over; rows below `cursor` were
    drawn; `pending` were drawn but are in no batch (queued, in flight or finished but unbatched)."""
    try:
        return json.dumps({"step": step, "cursor": cursor,
                           "pending": [{"index": p.index, "row": p.row} for p in pending]}).encode()
    except TypeError as e:
        raise TypeError(f"orchestrator.dataset rows must be JSON-able to checkpoint them: {e}") from None


def decode_state(data: bytes) -> tuple[int, int, list[Prompt]]:
    state = json.loads(data)
    return state["step"], state["cursor"], [Prompt(p["index"], p["row"]) for p in state["pending"]]
