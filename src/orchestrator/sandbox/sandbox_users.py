"""Who a sandboxed run is, as root: a user id of its own, one of a pool of SLOTS (no account needs to
exist), so that bwrap always runs unprivileged and two runs (of this process or another) never
share an id: a lock file per id."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import tempfile
from pathlib import Path

SLOTS = range(61000, 61256)
SLOT_WAIT_S = 120.0  # all taken (more concurrent runs than SLOTS): wait this long for one
LOCKS = Path(tempfile.gettempdir()) / "asyncrl-sandbox"


@contextlib.asynccontextmanager
async def free_slot():
    """A user id no other run holds now, for the length of a run, waiting while all SLOTS are
    taken (at most SLOT_WAIT_S)."""
    deadline = asyncio.get_running_loop().time() + SLOT_WAIT_S
    while (taken := _take_slot()) is None:
        if asyncio.get_running_loop().time() > deadline:
            raise RuntimeError(f"all {len(SLOTS)} sandbox user ids stayed in use for {SLOT_WAIT_S:.0f} s")
        await asyncio.sleep(0.05)
    uid, lock = taken
    try:
        yield uid
    finally:
        os.close(lock)


@contextlib.contextmanager
def slot():
    """free_slot for a caller outside the event loop (the probe), without waiting."""
    taken = _take_slot()
    if taken is None:
        raise RuntimeError(f"all {len(SLOTS)} sandbox user ids are in use")
    try:
        yield taken[0]
    finally:
        os.close(taken[1])


def _take_slot() -> tuple[int, int] | None:
    """(uid, its lock's fd) for a user id no other run holds (flock on a file per id, so other
    processes' runs count too), or None. A holder that died left nothing running: its runs died
    with it (bwrap's --die-with-parent)."""
    LOCKS.mkdir(mode=0o700, exist_ok=True)
    for uid in SLOTS:
        fd = os.open(LOCKS / str(uid), os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return uid, fd
    return None
