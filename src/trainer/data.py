"""From a handed-over batch (rl/transport.py) to padded micro-batch tensors on this rank."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rl.batch import Batch
from rl.transport import BatchReceiver


def receive_batch(receiver: BatchReceiver | None, kind: str, step: int, timeout_s: float,
                  device: torch.device) -> tuple[Batch, float]:
    """Batch `step` on every rank, and the seconds waited for it.

    Over the filesystem every rank reads the directory itself. Over ZMQ only rank 0 holds the
    socket; it passes the raw bytes on (a length, then a uint8 tensor), so the other ranks
    decode exactly what rank 0 checked, and no rank ever unpickles anything.
    """
    if kind == "filesystem" or dist.get_world_size() == 1:
        (meta, payload), waited = receiver.receive(step, timeout_s)
        return Batch.decode(meta, payload, receiver.source(step)), waited
    start = time.monotonic()
    if dist.get_rank() == 0:
        (meta, payload), _ = receiver.receive(step, timeout_s)
        sizes = torch.tensor([len(meta), len(payload)], dtype=torch.int64, device=device)
    else:
        sizes = torch.zeros(2, dtype=torch.int64, device=device)
    dist.broadcast(sizes, src=0)
    if dist.get_rank() == 0:
        blob = torch.frombuffer(bytearray(meta + payload), dtype=torch.uint8).to(device)
    else:
        blob = torch.empty(int(sizes.sum()), dtype=torch.uint8, device=device)
    dist.broadcast(blob, src=0)
    data = blob.cpu().numpy().tobytes()
    n = int(sizes[0])
    return Batch.decode(data[:n], data[n:], f"batch {step} from rank 0"), time.monotonic() - start


@dataclass
class MicroBatch:
    tokens: torch.Tensor  # [B, T] int64, right-padded
    attention_mask: torch.Tensor  # [B, T]
    loss_mask: torch.Tensor  # [B, T-1] float: 1 where the predicted token is trained on
    inference_logprobs: torch.Tensor  # [B, T-1]
    advantages: torch.Tensor  # [B, T-1]: per token (a teacher's signal differs token by token)


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
        if not chunk:
            # This rank has fewer samples than its peers have micro-batches (sample counts vary
            # when rollouts fail). It still must join every collective: one row of padding,
            # attended (an all-masked row would give NaN), with nothing to learn from.
            z = torch.zeros((1, 1))
            out.append(MicroBatch(torch.full((1, 2), pad_id, dtype=torch.long), torch.ones((1, 2), dtype=torch.long),
                                  z, z, z))
            continue
        width = max(s.stop - s.start for s, _ in chunk)
        tokens = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        attn = torch.zeros((len(chunk), width), dtype=torch.long)
        mask = torch.zeros((len(chunk), width))
        old = torch.zeros((len(chunk), width))
        adv = torch.zeros((len(chunk), width))
        for row, (s, _) in enumerate(chunk):
            n = s.stop - s.start
            tokens[row, :n] = torch.from_numpy(batch.tokens[s])
            attn[row, :n] = 1
            mask[row, :n] = torch.from_numpy(batch.loss_mask[s].astype("float32"))
            old[row, :n] = torch.from_numpy(batch.logprobs[s])
            adv[row, :n] = torch.from_numpy(batch.advantages[s])
        # Shift by one: position t predicts token t+1.
        out.append(MicroBatch(tokens, attn, mask[:, 1:], old[:, 1:], adv[:, 1:]))
    return out
