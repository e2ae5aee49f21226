"""From rollouts/step_n on disk to padded micro-batch tensors on this rank."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from rl.batch import Batch
from rl.rundir import RunDir

log = logging.getLogger("trainer")

HEARTBEAT_S = 30.0


def wait_for_batch(run: RunDir, step: int, timeout_s: float, poll_s: float = 0.05) -> tuple[Batch, float]:
    """Block until rollouts/step_<step> exists (it appears whole, by rename); returns it and the
    seconds waited. Logs a heartbeat while waiting so a stalled orchestrator is visible."""
    path = run.rollout_dir(step)
    start = last_beat = time.monotonic()
    while not path.exists():
        now = time.monotonic()
        if now - start > timeout_s:
            raise TimeoutError(f"no batch {step} at {path} after {timeout_s:.0f} s (trainer.batch_timeout_s); is the orchestrator running?")
        if now - last_beat > HEARTBEAT_S:
            log.info("waiting for batch %d (%s) for %.0f s", step, path, now - start)
            last_beat = now
        time.sleep(poll_s)
    return Batch.read(path), time.monotonic() - start


@dataclass
class MicroBatch:
    tokens: torch.Tensor  # [B, T] int64, right-padded
    attention_mask: torch.Tensor  # [B, T]
    loss_mask: torch.Tensor  # [B, T-1] float: 1 where the predicted token is trained on
    inference_logprobs: torch.Tensor  # [B, T-1]
    advantages: torch.Tensor  # [B, 1]


def rank_micro_batches(batch: Batch, rank: int, world: int, micro_batch_size: int, pad_id: int) -> list[MicroBatch]:
    """This rank's samples (every world-th, so ranks get similar lengths), in padded micro-batches.

    Every rank gets the same number of micro-batches: FSDP2's collectives run once per
    forward/backward, so a rank with one micro-batch more than its peers would hang them all.
    """
    if batch.num_samples < world:
        raise ValueError(f"batch {batch.step} has {batch.num_samples} samples, fewer than the {world} trainer ranks")
    slices = batch.sample_slices()[rank::world]
    indices = list(range(batch.num_samples))[rank::world]
    num_micro = -(-(-(-batch.num_samples // world)) // micro_batch_size)
    bounds = [round(i * len(slices) / num_micro) for i in range(num_micro + 1)]
    out = []
    for lo, hi in zip(bounds, bounds[1:]):
        chunk = list(zip(slices[lo:hi], indices[lo:hi]))
        width = max(s.stop - s.start for s, _ in chunk)
        tokens = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        attn = torch.zeros((len(chunk), width), dtype=torch.long)
        mask = torch.zeros((len(chunk), width))
        old = torch.zeros((len(chunk), width))
        for row, (s, _) in enumerate(chunk):
            n = s.stop - s.start
            tokens[row, :n] = torch.from_numpy(batch.tokens[s])
            attn[row, :n] = 1
            mask[row, :n] = torch.from_numpy(batch.loss_mask[s].astype("float32"))
            old[row, :n] = torch.from_numpy(batch.logprobs[s])
        adv = torch.tensor([[float(batch.advantages[i])] for _, i in chunk])
        # Shift by one: position t predicts token t+1.
        out.append(MicroBatch(tokens, attn, mask[:, 1:], old[:, 1:], adv))
    return out
