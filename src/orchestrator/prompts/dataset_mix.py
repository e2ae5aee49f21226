"""Datasets as the orchestrator uses them: where each prompt comes from (the seeded mix of the
configured datasets). How a row becomes prompt ids (the chat template, or raw text) is the
rendering station's (orchestrator/rendering/renderer.py); what scores it, the rewards station's.

The mix is a pure function of the seed: each draw picks a dataset by weight, then that dataset's
next row (a table's rows are reshuffled for every pass, a function's come in its own order). A
draw of a table row is just a position, so a resumed orchestrator replays `cursor` draws cheaply
and lands exactly where the run was (orchestrator/prompts/queue.py).
"""

from __future__ import annotations

import itertools
import logging
import random
from collections.abc import Iterator
from pathlib import Path

from orchestrator.callables import load_callable
from orchestrator.prompts.tables import Table, load_table
from rl.config import RunConfig
from rl.config.datasets import Dataset

log = logging.getLogger("orchestrator")


class RowError(Exception):
    """A row that can never make a rollout (no prompt, too long): dropped, not requeued. `fix`:
    what would make such rows usable, for the line that stops a run skipping every row
    (orchestrator/streaks.py)."""

    def __init__(self, message: str, fix: str, image: bool = False):
        super().__init__(message)
        self.fix, self.image = fix, image


def draw_order(n: int, ds: Dataset, seed: int, p: int) -> list[int]:
    """The positions of a dataset's table of `n` rows, as the run draws them in pass `p` (`seed`:
    the dataset's); a str seed gives the same order on every machine and Python run. The start-up
    check samples the same order (orchestrator/rendering/fit.py)."""
    order = list(range(n))
    if ds.spec.shuffle:
        random.Random(f"{seed}/{ds.name}/{p}").shuffle(order)
    return order


class Source:
    """One configured dataset: its rows, in the run's order. Its reward is the rewards station's
    (orchestrator/rewards/registry.py: configured_rewards, by the dataset's name)."""

    def __init__(self, ds: Dataset, seed: int):
        self.ds, self.name, self.spec = ds, ds.name, ds.spec
        self.seed = seed if self.spec.seed is None else self.spec.seed
        self.table: Table | None = None if self.spec.function else load_table(self.spec, self.seed)
        # Where a row's image paths may point (orchestrator/rendering/images.py): the dataset file's
        # directory, or for a function or HF dataset the directory the run started in.
        self.image_roots = [Path(self.spec.path).resolve().parent if self.spec.path else Path.cwd()]

    def draws(self) -> Iterator[int | dict]:
        """This dataset's order: positions in its table, or the rows of its function."""
        seed = self.seed
        if self.table is None:
            rows = load_callable(self.spec.function, f"dataset {self.name}: function")(seed)
            yield from rows
            return
        for p in itertools.count() if self.spec.passes is None else range(self.spec.passes):
            yield from draw_order(len(self.table), self.ds, seed, p)  # the order the start-up check samples

    def fetch(self, draw: int | dict) -> tuple[dict, str]:
        """(row, where it came from: for messages about it). Rewards read the reference answer
        as row["answer"] whatever the dataset's answer_key."""
        if self.table is None:
            row, where = draw, f"dataset {self.name}"
        else:
            row, where = self.table[draw], f"dataset {self.name} ({self.table.where} row {self.table.source_row(draw)})"
        key = self.spec.answer_key
        if key != "answer" and isinstance(row, dict) and key in row:
            row = {**row, "answer": row[key]}
        return row, where


def mix(sources: list[Source], seed: int) -> Iterator[tuple[str, int | dict]]:
    """The run's stream of (dataset name, draw). A used-up dataset leaves the mix."""
    live = list(sources)
    streams = {s.name: s.draws() for s in live}
    rng = random.Random(seed)
    while live:
        # One dataset draws no random numbers, so a run from before datasets could be mixed
        # resumes on the very same stream.
        s = live[0] if len(live) == 1 else rng.choices(live, weights=[x.spec.weight for x in live])[0]
        try:
            yield s.name, next(streams[s.name])
        except StopIteration:
            live.remove(s)


def configured_sources(cfg: RunConfig, evaluation: bool = False) -> list[Source]:
    """The run's training datasets (or, `evaluation`, its eval datasets), as row sources."""
    return [Source(ds, cfg.seed) for ds in cfg.orchestrator.resolved_datasets(evaluation)]
