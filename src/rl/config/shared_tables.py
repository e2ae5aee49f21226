"""The run's tables that more than one program follows: `[checkpoints]` (the trainer and the
orchestrator each keep theirs by the same count) and `[timeouts]` (bounds every program, or both
ends of the weight broadcast, wait under). A program's own bounds are its `timeouts` table:
inference.timeouts, orchestrator.timeouts, trainer.timeouts; every bound is named `<what>_s`."""

from __future__ import annotations

from pydantic import Field

from rl.config.section import Section


class CheckpointsConfig(Section):
    every: int = Field(50, ge=0)
    """Save a trainer checkpoint (model, optimizer, scheduler, step, RNG) every this many steps,
    and at the last step; 0 turns the trainer's checkpoints off. The orchestrator writes its own
    (step, data cursor, pending prompts) with every batch it hands over, whatever this is."""

    keep: int = Field(2, ge=1)
    """Checkpoints each program keeps on disk (the trainer's complete ones, the orchestrator's
    under checkpoints/); older ones are deleted."""


class SharedTimeoutsConfig(Section):
    """Bounds shared by the programs (seconds)."""

    heartbeat_s: float = Field(20, ge=5)
    """A program whose heartbeat file (output_dir/heartbeats/) has not changed for this long is
    reported dead, frozen or cut off by the programs watching it (judged by each watcher's own
    clock: hosts need no clock sync). On a network filesystem whose attribute cache delays
    changes, raise it above that delay (docs/multi-host.md)."""

    broadcast_s: float = Field(600, gt=0)
    """weight_sync.kind = "broadcast": longest the trainer and the servers' workers wait for every
    member to join the broadcast group, and for one broadcast."""
