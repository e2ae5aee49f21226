"""No run that spins: a cause that makes every row or group of a dataset come to nothing stops the
run with one line, instead of drawing new rows forever while the trainer waits for a batch.

Once, a tool environment's prompts were longer than seq_len: the orchestrator skipped every row it
drew (~250,000 warnings in ten minutes) and the trainer said "waiting for batch 1" every 30 s.
Whatever can recur without end is counted here, per cause and dataset, as a streak: futile
events in a row with no useful group of that dataset between them. A streak that reaches
orchestrator.max_futile_streak is the verdict: `Spinning`, naming the dataset, why (the last
event's reason) and the fix; the orchestrator's waits raise it (orchestrator/orchestrator.py)
and `rl orchestrator` prints it and exits 1 (orchestrator/main.py).

| cause | counted per | a streak of it means |
|---|---|---|
| skipped | dataset | no row of it can make a prompt (too long for seq_len, no prompt field, a template that fails) |
| failed | dataset | every group of it fails: its reward (or environment, or teacher) raises or times out |
| filtered | the run | filter_zero_variance drops every group: each got one reward for all its rollouts |

A useful group of a dataset ends that dataset's streaks and the run's filtered streak; a dataset
whose groups are filtered while another's fill batches does not stop the run (it may be
mastered). Servers have a bound in time instead (none in rotation for server_wait_timeout_s:
orchestrator/servers.py), with the same `Spinning` end. Prompts are not lost by a stop: those
drawn since the last checkpoint go out again after a resume (orchestrator/checkpoint.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

KEY = "orchestrator.max_futile_streak"
MEANING = {
    "skipped": "rows in a row skipped, none made a group",
    "failed": "groups in a row failed",
    "filtered": "groups in a row filtered for zero reward variance (orchestrator.filter_zero_variance)",
}


class Spinning(Exception):
    """The run can make no progress for a reason that does not pass by itself: one line naming the
    culprit, why, and what to change."""


@dataclass
class Streak:
    count: int = 0
    culprits: dict[str, None] = field(default_factory=dict)
    """Who took part (the run-wide filtered streak: each dataset seen), in order."""


class Streaks:
    def __init__(self, limit: int):
        """`limit`: events in a row that stop the run (0: never)."""
        self.limit = limit
        self.streaks: dict[tuple[str, str], Streak] = {}
        self.verdict: Spinning | None = None

    def hit(self, cause: str, who: str, why: str, fix: str) -> None:
        """A futile event of `cause` for `who` (a dataset or the environment, as said in logs)."""
        scope = "" if cause == "filtered" else who
        streak = self.streaks.setdefault((cause, scope), Streak())
        streak.count += 1
        streak.culprits[who] = None
        if self.limit and streak.count >= self.limit and self.verdict is None:
            self.verdict = Spinning(f"{', '.join(streak.culprits)}: {streak.count} {MEANING[cause]} ({KEY} = "
                                    f"{self.limit}); last: {why}; stopping: {fix}")

    def good(self, who: str) -> None:
        """A group of `who` went into the batches: its streaks and the run's filtered streak end."""
        for key in [("skipped", who), ("failed", who), ("filtered", "")]:
            self.streaks.pop(key, None)
