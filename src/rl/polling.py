"""Polling the shared directory with backoff.

Readers look for complete items (a renamed batch directory, a STABLE marker) by polling: inotify
sees nothing on NFS and other network filesystems. Each look is a metadata round trip to the file
server, so a reader that keeps finding nothing looks less and less often, up to a ceiling that
bounds the delay it adds once the item arrives; finding something starts it over.
"""

from __future__ import annotations


class Backoff:
    def __init__(self, first_s: float, max_s: float, factor: float = 1.5):
        self.first_s, self.max_s, self.factor = first_s, max(first_s, max_s), factor
        self.delay_s = first_s

    def next(self) -> float:
        """The pause before the next look (growing while nothing turns up)."""
        delay, self.delay_s = self.delay_s, min(self.delay_s * self.factor, self.max_s)
        return delay

    def reset(self) -> None:
        """Something turned up: the next wait starts short again."""
        self.delay_s = self.first_s
