"""The orchestrator's checkpoint, one per batch handed over: the batch's step, the data cursor
(rows drawn so far) and the prompts still pending (requeued, in flight, finished but not in a
batch), which a resumed orchestrator issues again (encoding: orchestrator/prompts.py)."""

from __future__ import annotations

import logging

from orchestrator.prompts import Prompt, decode_state, encode_state
from rl.preflight import orchestrator_state_refusal
from rl.rundir import RunDir, mark_stable, write_file_atomic
from rl.transport import BatchSender

log = logging.getLogger("orchestrator")


def resume_point(run_dir: RunDir, sender: BatchSender) -> tuple[int, int, list[Prompt]]:
    """(next step, data cursor, pending prompts): a fresh start, or where the last
    checkpoint left off."""
    saved = run_dir.checkpoint_steps("orchestrator")
    sender.discard_partial()
    if not saved:
        if refusal := orchestrator_state_refusal(run_dir):  # rl.cli refused it already
            raise SystemExit(refusal)
        return 1, 0, []
    path = run_dir.checkpoint_dir(saved[-1]) / "orchestrator" / "state.json"
    step, cursor, pending = decode_state(path.read_bytes())
    # A crash between handing batch n over and checkpointing it: batch n is out, its prompts
    # are still listed as pending and go out again; batch numbers stay contiguous.
    last = sender.last_handed_over(step)
    log.info("resuming after batch %d from %s: %d rows drawn, %d pending prompts re-issued",
             last, path, cursor, len(pending))
    return last + 1, cursor, pending


def save_checkpoint(run_dir: RunDir, step: int, cursor: int, pending: list[Prompt], keep: int) -> None:
    """Checkpoint batch `step`, keeping the newest `keep` checkpoints."""
    directory = run_dir.checkpoint_dir(step) / "orchestrator"
    directory.mkdir(parents=True, exist_ok=True)
    write_file_atomic(directory / "state.json", encode_state(step, cursor, pending))
    mark_stable(directory)
    for old in run_dir.checkpoint_steps("orchestrator")[:-keep]:
        run_dir.remove_checkpoint(old, "orchestrator")
