"""multiprocessing's resource tracker, told not to warn. vLLM's engine processes share memory
segments that each unlinks as it exits; one killed at the end of its shutdown grace (a loaded
machine) leaves its segment to the tracker, which unlinks it at exit but first prints "There
appear to be N leaked shared_memory objects" into the user's terminal. Nothing is left behind
either way, so `rl run`'s children and `rl inference` start their trackers with this filter.
"""

from __future__ import annotations

import os

FILTER = "ignore::UserWarning:multiprocessing.resource_tracker"


def pythonwarnings() -> str:
    """PYTHONWARNINGS with the filter added to what the user set."""
    return ",".join(w for w in (os.environ.get("PYTHONWARNINGS"), FILTER) if w)
