"""No run that spins: a cause that makes every row or group of a dataset come to nothing stops the
run with one line, instead of drawing new rows forever while the trainer waits for a batch.

Once, a tool environment's prompts were longer than seq_len: the orchestrator skipped every row it
drew (~250,000 warnings in ten minutes) and the trainer said "waiting for batch 1" every 30 s.
Whatever can recur without end is counted here, per cause and dataset, as a streak: futile
events in a row with nothing between them that shows the cause has passed. A streak that reaches
orchestrator.scheduling.max_futile_streak events, and has lasted the cause's minimum span, is the verdict:
`Spinning`, naming the dataset, what was counted, the last event's reason and the fix; the
orchestrator's waits raise it (orchestrator/orchestrator.py) and `rl orchestrator` prints it and
exits 1 (orchestrator/main.py).

| cause | counted per | ended by | a streak of it means |
|---|---|---|---|
| skipped | dataset | a row of it rendered (its request built) | no row of it can make a prompt (too long for seq_len, no prompt field, a template that fails) |
| failed | dataset | a group of it scored (filtered or not) | every group of it fails: its reward (or environment, or teacher) raises or times out |
| filtered | the run | a group of any dataset in a batch | filter_zero_variance drops every group: each got one reward for all its rollouts |

Why each ends where it does: a skip is decided when a row is rendered, before anything is
generated, so at start-up produce() fills every free slot with rows of which a share f are
unusable: ~max_in_flight_groups * f / (1 - f) skips come before any group finishes, and a run
that would progress must not be stopped for them. A rendered row proves the dataset has usable
rows; a scored group proves its reward answers.

Minimum span: a count alone cannot tell a cause that passes from one that does not when events
come fast. A reward endpoint or teacher refusing connections while it restarts fails each group
in milliseconds: 32 groups in flight retried 3 times make 200 failures in under a second. So
`failed` also needs its streak to have lasted as long as the run would wait for a slow reward
or teacher before calling it down (group_outcomes.futile_spans: MAX_ATTEMPTS x timeouts.reward_s,
timeouts.request_s for a teacher). Skips and filtered groups are verdicts on the data, not on
something that restarts: counts alone.

A dataset whose groups are filtered while another's fill batches does not stop the run (it may be
mastered). Servers have a bound in time instead (none in rotation for timeouts.server_wait_s:
orchestrator/servers/pool.py), with the same `Spinning` end. Prompts are not lost by a stop: those
drawn since the last checkpoint go out again after a resume (orchestrator/checkpoint.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

KEY = "orchestrator.scheduling.max_futile_streak"
MEANING = {
    "skipped": "rows in a row could not be rendered within seq_len (none of its rows made a request between them)",
    "failed": "groups in a row failed (none of its groups was scored between them)",
    "filtered": "groups in a row filtered for zero reward variance (orchestrator.scheduling.filter_zero_variance)",
}


class Spinning(Exception):
    """The run can make no progress for a reason that does not pass by itself: one line naming the
    culprit, why, and what to change."""


@dataclass
class Streak:
    started: float
    """When its first event came (the clock of Streaks)."""
    count: int = 0
    culprits: dict[str, None] = field(default_factory=dict)
    """Who took part (the run-wide filtered streak: each dataset seen), in order."""


class Streaks:
    def __init__(self, limit: int, spans: dict[str, float] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        """`limit`: events in a row that stop the run (0: never); `spans`: per cause, seconds its
        streak must also have lasted (absent: none); `clock`: seconds, for tests to pass their own."""
        self.limit, self.spans, self.clock = limit, spans or {}, clock
        self.streaks: dict[tuple[str, str], Streak] = {}
        self.verdict: Spinning | None = None

    def hit(self, cause: str, who: str, why: str, fix: str) -> None:
        """A futile event of `cause` for `who` (a dataset or the environment, as said in logs)."""
        scope = "" if cause == "filtered" else who
        now = self.clock()
        streak = self.streaks.setdefault((cause, scope), Streak(now))
        streak.count += 1
        streak.culprits[who] = None
        lasted, span = now - streak.started, self.spans.get(cause, 0.0)
        if not self.limit or streak.count < self.limit or lasted < span or self.verdict is not None:
            return
        over = f" over {lasted:.0f} s" if span else ""
        self.verdict = Spinning(f"{', '.join(streak.culprits)}: {streak.count} {MEANING[cause]}{over} ({KEY} = "
                                f"{self.limit}); last: {why}; stopping: {fix}")

    def rendered(self, who: str) -> None:
        """A row of `who` made a request: it has usable rows."""
        self.streaks.pop(("skipped", who), None)

    def scored(self, who: str) -> None:
        """A group of `who` got its rewards (filtered or not): what scores it answers."""
        self.streaks.pop(("failed", who), None)

    def good(self, who: str) -> None:
        """A group of `who` went into the batches: its streaks and the run's filtered streak end."""
        for key in [("skipped", who), ("failed", who), ("filtered", "")]:
            self.streaks.pop(key, None)
