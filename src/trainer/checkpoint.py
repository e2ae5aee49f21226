"""Trainer checkpoints: checkpoints/step_n/trainer/, written with torch.distributed.checkpoint.

    __*.distcp, .metadata   model and optimizer (with LoRA: the run's adapter and its optimizer
                            state), each rank writing its own shards (DCP)
    rng_rank<r>.safetensors that rank's torch RNG state (dropout), no pickle
    trainer.json            step, world size, LR scheduler state
    STABLE                  written last, once every rank has finished

Resuming on another world size works for model and optimizer (DCP reshards); RNG states are
restored only on the same world size. DCP's .metadata file is a pickle that only the trainer
itself writes, inside the run directory; nothing from another program is ever unpickled.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

from rl.rundir import RunDir, mark_stable, remove_quietly, write_file_atomic

log = logging.getLogger("trainer")

PROGRAM = "trainer"


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def save(run: RunDir, step: int, state: dict, scheduler, keep: int, record: dict | None = None) -> float:
    """Collective: every rank calls it with its part of `state` (nested dicts of tensors and
    DTensors); `record`: the step's metrics record (rank 0), kept for a restart that finds it
    missing from metrics.jsonl. Returns seconds taken."""
    start = time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    out = run.checkpoint_dir(step) / PROGRAM
    if rank == 0:
        remove_quietly(out)  # a partial one from a crash has no STABLE; start it over
        out.mkdir(parents=True)
    dist.barrier()
    dcp.save(state, checkpoint_id=out)
    save_file(_rng_state(), out / f"rng_rank{rank}.safetensors")
    dist.barrier()  # every rank's files are complete before STABLE claims so
    if rank == 0:
        meta = {"step": step, "world_size": world, "scheduler": scheduler.state_dict(),
                **({"record": record} if record else {})}
        write_file_atomic(out / "trainer.json", json.dumps(meta).encode())
        mark_stable(out)
        _prune(run, keep)
    return time.perf_counter() - start


def _prune(run: RunDir, keep: int) -> None:
    for n in run.checkpoint_steps(PROGRAM)[:-keep]:
        run.remove_checkpoint(n, PROGRAM)


def latest(run: RunDir) -> int | None:
    steps = run.checkpoint_steps(PROGRAM)
    return steps[-1] if steps else None


def load(run: RunDir, step: int, state: dict, scheduler) -> dict | None:
    """Collective: load `state` in place (tensors of the right sharding, as save() got them),
    the scheduler and (same world size) RNG from step. Returns the step's metrics record as
    save() kept it, if it did."""
    src: Path = run.checkpoint_dir(step) / PROGRAM
    dcp.load(state, checkpoint_id=src)
    meta = json.loads((src / "trainer.json").read_text())
    scheduler.load_state_dict(meta["scheduler"])
    rank, world = dist.get_rank(), dist.get_world_size()
    if meta["world_size"] == world:
        rng = load_file(src / f"rng_rank{rank}.safetensors")
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    elif rank == 0:
        log.warning("checkpoint step %d was written by %d ranks, resuming on %d: RNG streams start afresh",
                    step, meta["world_size"], world)
    return meta.get("record")
