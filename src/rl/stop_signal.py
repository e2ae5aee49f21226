"""SIGTERM as an exception that unwinds the main thread, and that is never lost.

Python runs a signal handler in the main thread between two bytecodes, wherever that thread is.
When that is inside a finalizer (a `__del__`, a weakref callback), an exception the handler raises
goes to sys.unraisablehook, is printed as "Exception ignored in ...", and dropped: the program
goes on as if no signal had come. Seen once in a fresh-clone suite run: the trainer of a
SIGKILLed `rl run`, told to stop by PR_SET_PDEATHSIG while a regex object was being collected,
waited for its next batch for ever. So a stop dropped that way is sent again from a thread a
moment later, when the finalizer has returned. Used by the programs that stop by unwinding: the
trainer and `rl run`'s launcher (the orchestrator cancels its asyncio task instead).

die_with_parent: the other half, for a program's children: Linux SIGTERMs them when it dies.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable

RESEND_S = 0.1  # the finalizer that swallowed the stop has returned by then


def raise_on_sigterm(stop: Callable[[], BaseException]) -> None:
    """SIGTERM raises stop() in the main thread; a stop a finalizer swallowed is sent again."""

    def on_sigterm(*_):
        raise stop()

    previous = sys.unraisablehook

    def on_unraisable(unraisable) -> None:
        previous(unraisable)  # still said, as Python would
        if isinstance(unraisable.exc_value, (SystemExit, KeyboardInterrupt)):
            resend = threading.Timer(RESEND_S, os.kill, (os.getpid(), signal.SIGTERM))
            resend.daemon = True
            resend.start()

    sys.unraisablehook = on_unraisable
    signal.signal(signal.SIGTERM, on_sigterm)


def die_with_parent() -> None:
    """In the child (Popen's preexec_fn): ask Linux to SIGTERM it when its parent dies, even by
    SIGKILL (rl run's programs, rl sft's evaluator, rl eval's server)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: Ctrl-C and SIGTERM still stop the children through the launcher
