"""A warning that can repeat without end, said at a bounded rate: a reward that always raises, an
environment whose every episode fails, eval rows that cannot be rendered would otherwise write a
line per rollout or row (thousands before the run is stopped or the evaluation ends)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

QUIET_S = 10.0  # a failure like the one before is said at most this often


class Quiet:
    """Says a warning at once, then one like the last (the same `kind`) at most every QUIET_S, with
    how many were not said since. (Called from reward threads too: a count off by one is harmless.)"""

    def __init__(self, log: logging.Logger, quiet_s: float = QUIET_S, clock: Callable[[], float] = time.monotonic):
        self.log, self.quiet_s, self.clock = log, quiet_s, clock
        self.last: str | None = None
        self.unsaid, self.said_at = 0, float("-inf")

    def warn(self, kind: str, line: str) -> bool:
        """Say `line` unless it repeats `kind` within quiet_s of the last said; True if said."""
        repeated = kind == self.last and self.clock() - self.said_at < self.quiet_s
        self.last = kind
        if repeated:
            self.unsaid += 1
            return False
        also = f" ({self.unsaid} more like the one before not shown)" if self.unsaid else ""
        self.unsaid, self.said_at = 0, self.clock()
        self.log.warning("%s%s", line, also)
        return True
