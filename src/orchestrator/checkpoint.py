"""The orchestrator's checkpoint, one per batch, written just before the batch is handed over:
the batch's step, the prompts it is made of, the data cursor (rows drawn so far) and the prompts
still pending (requeued, in flight, finished but not in a batch). Encoding: orchestrator/prompts.py.

Written first so that every prompt lands in exactly one trained batch whenever the orchestrator
dies: a resumed orchestrator asks whether batch n reached the trainer (its directory is on disk,
written by the orchestrator or, over ZMQ, kept by the trainer on receipt, or the trainer already
published version n). If so, its prompts are done; if not, batch n is made again from exactly
those prompts (over ZMQ a trainer that did get the first copy drops the second).
"""

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
    step, cursor, pending, handing = decode_state(path.read_bytes())
    delivered = max([0, *run_dir.rollout_steps(), run_dir.latest_stable_weights() or 0])
    if delivered >= step:
        last = delivered
    else:  # batch `step` never reached the trainer: made again, of the same prompts
        last, pending = step - 1, [*handing, *pending]
    log.info("resuming after batch %d from %s: %d rows drawn, %d pending prompts re-issued",
             last, path, cursor, len(pending))
    return last + 1, cursor, pending


def save_checkpoint(run_dir: RunDir, step: int, cursor: int, pending: list[Prompt], handing: list[Prompt],
                    keep: int) -> None:
    """Checkpoint batch `step`, made of `handing`, keeping the newest `keep` checkpoints."""
    directory = run_dir.checkpoint_dir(step) / "orchestrator"
    directory.mkdir(parents=True, exist_ok=True)
    write_file_atomic(directory / "state.json", encode_state(step, cursor, pending, handing))
    mark_stable(directory)
    for old in run_dir.checkpoint_steps("orchestrator")[:-keep]:
        run_dir.remove_checkpoint(old, "orchestrator")
