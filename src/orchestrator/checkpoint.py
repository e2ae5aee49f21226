"""The orchestrator's checkpoint, one per batch, written just before the batch is handed over:
the batch itself (encoded, as it goes to the trainer), the data cursor (rows drawn so far) and the
prompts still pending (requeued, in flight, finished but not in a batch). Encoding of the state:
orchestrator/prompts/queue.py.

Written first, with the batch, so that every prompt lands in exactly one trained batch whenever
the orchestrator dies: a resumed orchestrator asks whether batch n reached the trainer (its
directory is on disk, written by the orchestrator or, over ZMQ, kept by the trainer on receipt,
or the trainer already published version n). If so, it goes on with n+1; if not, it hands over
the very bytes it checkpointed (a ZMQ trainer that did get the first copy drops the second).
A batch is never made twice, so no two copies of it can hold different prompts.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from orchestrator.preflight import orchestrator_state_refusal
from orchestrator.prompts import Prompt, decode_state, encode_state
from rl.batch import Batch
from rl.rundir import RunDir, mark_stable, write_file_atomic
from rl.transport.interface import BatchSender

log = logging.getLogger("orchestrator")


class ResumePoint(NamedTuple):
    """Where a run goes on: a fresh start, or where the last checkpoint left off."""
    next_step: int
    cursor: int  # rows drawn so far
    pending: list[Prompt]  # drawn, not in a batch: they go out first
    curriculum: dict | None  # the curriculum's record
    unsent: Batch | None  # the checkpointed batch, to hand over again


def resume_point(run_dir: RunDir, sender: BatchSender) -> ResumePoint:
    """Where the last checkpoint left off, or a fresh start."""
    saved = run_dir.checkpoint_steps("orchestrator")
    sender.discard_partial()
    if not saved:
        if refusal := orchestrator_state_refusal(run_dir):  # asyncrl.main refused it already
            raise SystemExit(refusal)
        return ResumePoint(1, 0, [], None, None)
    directory = run_dir.checkpoint_dir(saved[-1]) / "orchestrator"
    step, cursor, pending, curriculum = decode_state((directory / "state.json").read_bytes())
    delivered = max([0, *run_dir.rollout_steps(), run_dir.latest_stable_weights() or 0])
    again = None
    if delivered < step:  # batch `step` may never have reached the trainer: the same bytes again
        again = Batch.read(directory / "batch")
    log.info("resuming after batch %d from %s: %d rows drawn, %d pending prompts re-issued%s", step, directory,
             cursor, len(pending), f"; batch {step} handed over again" if again else "")
    return ResumePoint(step + 1, cursor, pending, curriculum, again)


def save_checkpoint(run_dir: RunDir, step: int, encoded: tuple[bytes, bytes], cursor: int, pending: list[Prompt],
                    keep: int, curriculum: dict[str, list] | None = None) -> None:
    """Checkpoint batch `step` (`encoded`: its Batch.encode()) before it is handed over, keeping
    the newest `keep` checkpoints."""
    directory = run_dir.checkpoint_dir(step) / "orchestrator"
    directory.mkdir(parents=True, exist_ok=True)
    Batch.write_encoded(*encoded, directory / "batch")
    write_file_atomic(directory / "state.json", encode_state(step, cursor, pending, curriculum))
    mark_stable(directory)
    for old in run_dir.checkpoint_steps("orchestrator")[:-keep]:
        run_dir.remove_checkpoint(old, "orchestrator")


def checkpointed_batch(run_dir: RunDir, step: int) -> Batch:
    """Batch `step` as its checkpoint holds it (the bytes handed over)."""
    return Batch.read(run_dir.checkpoint_dir(step) / "orchestrator" / "batch")
