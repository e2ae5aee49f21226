"""The prompt queue: the datasets' seeded mix (orchestrator/prompts/dataset_mix.py) plus prompts given back
(by cancelled, failed or stale groups), which go out again before any new row; with a curriculum
(orchestrator/prompts/curriculum.py) a new draw goes out only if it admits it. Its state (how
many rows were drawn, which prompts are pending) is what the orchestrator checkpoints, so a
resumed run neither skips nor repeats data.
"""

from __future__ import annotations

import collections
import itertools
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Prompt:
    index: int
    """Position of the row in the seeded stream: identifies it across requeues and resumes."""
    row: dict
    source: str = ""
    """Name of the dataset it came from ("": the only one)."""
    where: str = ""
    """Where the row came from (file and row), for messages about it."""


# (dataset name, draw) -> (row, where): a draw is a table position or a function's row.
Fetch = Callable[[str, object], tuple[dict, str]]


class PromptQueue:
    def __init__(self, draws: Iterator[tuple[str, object]], fetch: Fetch, cursor: int = 0,
                 pending: list[Prompt] = (), admit: Callable[[Prompt], bool] | None = None):
        # The stream is re-made from the seed, so skipping `cursor` draws lands where the run was.
        self.draws = itertools.islice(draws, cursor, None)
        self.fetch = fetch
        self.cursor = cursor
        self.requeued: collections.deque[Prompt] = collections.deque(pending)
        # Whether a new draw is generated (orchestrator/prompts/curriculum.py); None: every one.
        self.admit = admit

    def take(self) -> Prompt:
        if self.requeued:
            return self.requeued.popleft()
        while True:
            prompt = self.draw()
            if self.admit is None or self.admit(prompt):
                return prompt

    def draw(self) -> Prompt:
        try:
            source, draw = next(self.draws)
        except StopIteration:
            raise RuntimeError(f"the datasets ran out after {self.cursor} rows (a function dataset must "
                               "yield enough rows for max_steps; a dataset with passes set leaves the mix "
                               "once used up)") from None
        row, where = self.fetch(source, draw)
        if not isinstance(row, dict):
            raise TypeError(f"{where}: row {self.cursor} is a {type(row).__name__}, not a dict")
        prompt = Prompt(self.cursor, row, source, where)
        self.cursor += 1
        return prompt

    def give_back(self, prompt: Prompt) -> None:
        self.requeued.append(prompt)


def encode_state(step: int, cursor: int, pending: list[Prompt], curriculum: dict[str, list] | None = None) -> bytes:
    """The orchestrator's checkpoint: batches 1..step are made (batch `step` is checkpointed
    beside it, orchestrator/checkpoint.py); rows below `cursor` were drawn; `pending` were drawn
    but are in no batch (queued, in flight or finished but unbatched); `curriculum`: its record
    of pass rates (orchestrator/prompts/curriculum.py), in order."""
    try:
        # default=str: a file's dates and the like come back as text, which no reward has relied on.
        return json.dumps({"step": step, "cursor": cursor,
                           "pending": [{"index": p.index, "row": p.row, "source": p.source, "where": p.where}
                                       for p in pending],
                           **({"curriculum": curriculum} if curriculum is not None else {})}, default=str).encode()
    except TypeError as e:
        raise TypeError(f"dataset rows must be JSON-able to checkpoint them: {e}") from None


def decode_state(data: bytes) -> tuple[int, int, list[Prompt], dict[str, list] | None]:
    state = json.loads(data)
    return state["step"], state["cursor"], [Prompt(p["index"], p["row"], p.get("source", ""), p.get("where", ""))
                                            for p in state["pending"]], state.get("curriculum")
