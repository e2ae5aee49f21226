"""Curriculum by pass rate (`[orchestrator.curriculum]`): keep batches informative before
generating, not after.

Zero-variance filtering (orchestrator.scheduling.filter_zero_variance) drops a group once it has been
generated and every rollout got the same reward: the generation was spent for nothing. Here each
row's pass rate in its latest group (the share of rollouts with reward >= pass_threshold) is
recorded, and when the datasets' stream draws that row again it is admitted only if the rate
lies strictly inside `band` (low, high) (a group that can still teach), or else with probability
`revisit_easy` / `revisit_hard`, so that easy and hard rows are tried now and then and their
record stays current. A row counts as hard only after `hard_after` groups in a row at or below
low (one group of 8 misjudges a row the policy passes 1 time in 10 as hopeless 43% of the time),
and never once a group of it has passed above low: a row the policy has done is within its
reach, and the groups it fails are where it learns (or relearns) it, not generation spent for
nothing.
Rows never seen are always admitted. Nothing is reweighted: an admitted row is trained on as any
other, the curriculum only decides which rows the generation is spent on.

A row is known by a hash of its dataset and content, so it is recognised on every pass over the
data. Whether a draw is admitted depends only on the record and the draw's position in the
stream (its own seeded random number), and the record is saved in the orchestrator's checkpoint:
a resumed run makes the same decisions from the same record.
"""

from __future__ import annotations

import collections
import hashlib
import json
import random

from orchestrator.prompts.queue import Prompt
from rl.config.rollout_tables import CurriculumConfig


def row_key(prompt: Prompt) -> str:
    """A row's identity across passes: its dataset's name and its content."""
    text = json.dumps([prompt.source, prompt.row], sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


class Curriculum:
    def __init__(self, cfg: CurriculumConfig, seed: int, record: dict[str, list] | None = None):
        self.cfg, self.seed = cfg, seed
        # Row key -> its latest group's pass rate, least recently scored first (evicted first);
        # how many of its groups in a row were at or below band's low (hard_after); whether any of
        # its groups was ever above it.
        self.rates: collections.OrderedDict[str, float] = collections.OrderedDict()
        self.failures: dict[str, int] = {}
        self.passed: dict[str, bool] = {}
        for key, value in (record or {}).items():
            self.rates[key], self.failures[key], self.passed[key] = self._entry(value)
        self.skipped = 0  # draws not admitted since the last report
        self.scored_rates: list[float] = []  # pass rates of the groups scored since the last report

    def _entry(self, value: float | list) -> tuple[float, int, bool]:
        """A checkpointed entry: [rate, failures, passed]; older records held [rate, failures] or
        the rate alone, read as one failure at the band's low and "passed" above it."""
        value = value if isinstance(value, list) else [value, int(value <= self.cfg.band[0])]
        rate, failures = value[0], int(value[1])
        return rate, failures, bool(value[2]) if len(value) > 2 else rate > self.cfg.band[0]

    def category(self, rate: float) -> str:
        low, high = self.cfg.band
        return "hard" if rate <= low else "easy" if rate >= high else "informative"

    def admit(self, prompt: Prompt) -> bool:
        """Whether a freshly drawn row is generated (PromptQueue calls it on each new draw)."""
        key = row_key(prompt)
        rate = self.rates.get(key)
        if rate is None or (kind := self.category(rate)) == "informative":
            return True
        if kind == "hard" and (self.passed[key] or self.failures[key] < self.cfg.hard_after):
            return True  # passed before, or not yet judged hopeless: another group first
        # One number per stream position: the same decision on a resumed run.
        chance = self.cfg.revisit_easy if kind == "easy" else self.cfg.revisit_hard
        if random.Random(f"{self.seed}-{prompt.index}").random() < chance:
            return True
        self.skipped += 1
        return False

    def scored(self, prompt: Prompt, rewards: list[float]) -> None:
        """A group's rewards: its row's pass rate, recorded (the oldest record goes past max_rows)."""
        rate = sum(r >= self.cfg.pass_threshold for r in rewards) / len(rewards)
        key = row_key(prompt)
        self.rates.pop(key, None)
        self.rates[key] = rate
        self.failures[key] = self.failures.get(key, 0) + 1 if rate <= self.cfg.band[0] else 0
        self.passed[key] = self.passed.get(key, False) or rate > self.cfg.band[0]
        while len(self.rates) > self.cfg.max_rows:
            oldest = self.rates.popitem(last=False)[0]
            del self.failures[oldest], self.passed[oldest]
        self.scored_rates.append(rate)

    def report(self) -> dict[str, float]:
        """The step's metrics: rows skipped, this step's groups by pass rate, the record's shares."""
        groups = collections.Counter(self.category(r) for r in self.scored_rates)
        record = collections.Counter(self.category(r) for r in self.rates.values())
        n, m = max(len(self.scored_rates), 1), max(len(self.rates), 1)
        out = {"curriculum/skipped": self.skipped, "curriculum/rows_recorded": len(self.rates),
               "curriculum/pass_rate_mean": sum(self.scored_rates) / n,
               **{f"curriculum/groups_{c}_frac": groups[c] / n for c in ("easy", "informative", "hard")},
               **{f"curriculum/rows_{c}_frac": record[c] / m for c in ("easy", "informative", "hard")}}
        self.skipped, self.scored_rates = 0, []
        return out

    def state(self) -> dict[str, list]:
        """For the checkpoint: the record, in its order: [pass rate, hard groups in a row, passed
        ever (0/1)] per row."""
        return {key: [rate, self.failures[key], int(self.passed[key])] for key, rate in self.rates.items()}
