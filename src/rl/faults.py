"""Crash points: where the fault suite (tests/faults/) kills a program at an exact moment.

    ASYNCRL_CRASH_AT=weights.staged:3 rl trainer @ cfg.toml

makes the trainer SIGKILL itself once version 3's files are written but not yet published. A
signal from outside cannot hit a window of a few milliseconds reliably; this can, and what
follows is the real thing: no cleanup, no exit handler, files as they were. Unset (always, outside
the tests), each point costs one dictionary lookup.

Points: orchestrator.checkpointed (the batch's checkpoint written, the batch not yet handed
over), batch.staged (orchestrator: batch files written, not renamed into place),
orchestrator.handed_over (batch handed over), weights.staged (trainer:
version files written, not renamed into place), trainer.checkpointed (step trained, published and
checkpointed, its metrics record not yet written), trainer.after_step (step trained, published and
checkpointed, before the next batch), eval.recorded (`rl eval --follow`: a step's record written).
"""

from __future__ import annotations

import os
import signal

ENV = "ASYNCRL_CRASH_AT"


def crash_point(point: str, step: int) -> None:
    if os.environ.get(ENV) == f"{point}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)
