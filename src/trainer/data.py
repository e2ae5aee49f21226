"""From a handed-over batch (rl/transport/interface.py) to this rank's micro-batches.

Three decisions, all made from the whole batch, which every rank holds, so every rank computes
the same plan without talking to the others:
  1. which samples each rank trains on: longest first, each to the rank with the fewest tokens
     so far, so ranks finish their forward/backward passes together;
  2. how a rank's samples form micro-batches: packed into rows of at most seq_len tokens
     (first-fit decreasing), positions restarting per sample, a few rows per micro-batch; or
     padded to a common length;
  3. how much each token weighs in the loss (the normalisation), so that the loss and its
     gradient do not depend on how samples fall into micro-batches and ranks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from rl.batch import Batch, BatchError
from rl.transport.interface import BatchReceiver
from trainer.parallel import share_bytes
from trainer.sampling_mask import NO_TRUNCATION, NoTruncation, Truncation, is_truncated


def receive_batch(receiver: BatchReceiver | None, step: int, timeout_s: float,
                  device: torch.device) -> tuple[Batch, float]:
    """Batch `step` on every rank, and the seconds waited for it.

    Only rank 0 holds the receiver (the directory or the socket): it checks the batch (and
    rejects a damaged one, rl/transport/files.py) and passes the raw bytes on (trainer/parallel.py
    share_bytes), so the other ranks decode exactly what rank 0 checked, all ranks train on the
    same batch even if its file is replaced meanwhile, and no rank ever unpickles anything.
    """
    if dist.get_world_size() == 1:
        got = receiver.receive(step, timeout_s)
        return got.batch, got.waited_s
    start = time.monotonic()
    header = data = None
    if dist.get_rank() == 0:
        try:
            got = receiver.receive(step, timeout_s)
        except (BatchError, TimeoutError) as e:
            # The other ranks wait in share_bytes: they raise the same error instead of taking
            # whatever rank 0 shares next for this batch.
            share_bytes(b"!" + f"{type(e).__name__}: {e}".encode(), device)
            raise
        header, data = str(len(got.meta)).encode(), got.meta + got.payload
    header = share_bytes(header, device)
    if header.startswith(b"!"):
        raise BatchError(f"rank 0 could not receive batch {step}: {header[1:].decode()}")
    n = int(header)
    data = share_bytes(data, device)
    return Batch.decode(data[:n], data[n:], f"batch {step} from rank 0"), time.monotonic() - start


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without a round trip: from pageable memory CUDA first finishes
    every queued kernel (the host waits on the last micro-batch's backward before it can queue
    the next forward); from pinned memory the copy is queued like a kernel."""
    if device.type != "cuda" or x.device.type != "cpu":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)


@dataclass
class MicroBatch:
    tokens: torch.Tensor  # [R, T] int64
    position_ids: torch.Tensor | None  # [R, T]: restart at 0 per packed sample; None when padded
    attention_mask: torch.Tensor | None  # [R, T] when padded; None when packed (transformers
    # derives a block-diagonal causal mask, or varlen flash attention, from the position ids)
    # Aligned on the predicted token, [R, T-1] (position t predicts token t+1):
    loss_mask: torch.Tensor  # float, 1 where the token is trained on
    inference_logprobs: torch.Tensor
    advantages: torch.Tensor  # per token: a teacher's signal differs token by token
    loss_weight: torch.Tensor  # the token's share of the batch loss (the normalisation)
    sequence_ids: torch.Tensor  # int64 sample index in the batch, -1 on padding
    # The temperature the token was sampled at (its sample's): the trainer divides the logits
    # predicting it by this. 1.0 where no sample owns the prediction (padding, a packed-sample
    # boundary): any positive value keeps those logits finite, and a NaN there would reach the
    # gradient through log_softmax's backward even though the loss masks the token.
    temperature: torch.Tensor
    # The rest of the token's sampling settings (vLLM's "off": -1, 1.0, 0.0, also where no
    # sample owns the prediction): the trainer rebuilds the kept set from them
    # (trainer/sampling_mask.py).
    top_k: torch.Tensor  # int64
    top_p: torch.Tensor
    min_p: torch.Tensor
    # [R, T-1, K] int32: the sampler's kept ids for the predicted token, -1 padded (all -1: none
    # recorded, rebuild); None when the batch recorded none.
    kept: torch.Tensor | None = None
    # [R, T, layers, top_k] int64: the engine's routed experts at each input position, and [R, T]
    # bool where there is one (trainer/routing_replay.py); None when the batch carries none.
    routing: torch.Tensor | None = None
    routed: torch.Tensor | None = None
    # The images (PNG bytes) of the micro-batch's samples in the order of their placeholders in
    # the rows, row after row (trainer/vision.py fills the placeholders in that order); None when
    # the batch carries none.
    images: list[bytes] | None = None
    # [R, T] bool, with images: where the engine sampled the token. A sampled image token (the
    # model may write <image>) is text to the engine, not a placeholder (trainer/vision.py).
    sampled: torch.Tensor | None = None

    def truncation(self, vocab: int) -> Truncation | NoTruncation:
        """The loss tokens of samples drawn from a truncated distribution, with their settings;
        NO_TRUNCATION when there are none (the common untruncated batch pays nothing)."""
        select = is_truncated(self.top_k, self.top_p, self.min_p, vocab) & (self.loss_mask > 0)
        if not bool(select.any()):
            return NO_TRUNCATION
        return Truncation(self.top_k, self.top_p, self.min_p, select, kept=self.kept)


def assign_ranks(lengths: list[int], world: int) -> list[list[int]]:
    """Sample indices per rank, balancing tokens (longest-processing-time-first). With fewer
    samples than ranks some ranks get none and run padding passes only."""
    load = [0] * world
    ranks: list[list[int]] = [[] for _ in range(world)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        ranks[r].append(i)
        load[r] += lengths[i]
    return ranks


def pack(indices: list[int], lengths: list[int], budget: int) -> list[list[int]]:
    """First-fit decreasing: bins of at most `budget` tokens (a longer sample gets its own bin)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(budget - lengths[i])
    return bins


def loss_weights(batch: Batch, normalization: str, norm_length: int) -> np.ndarray:
    """Per-token weight such that the batch loss is sum(weight * per-token loss); see
    [trainer.loss] normalization."""
    mask = batch.loss_mask.astype(np.float64)
    # A sample's first token is never predicted (nothing precedes it in its sample), so it
    # cannot carry loss, whatever its mask says.
    mask[np.cumsum(batch.lengths) - batch.lengths] = 0.0
    weights = np.zeros_like(mask)
    if normalization == "token":
        weights[:] = 1.0 / max(mask.sum(), 1.0)
    elif normalization == "sequence":
        slices = batch.sample_slices()
        counts = [mask[s].sum() for s in slices]
        trained = sum(1 for c in counts if c > 0)
        for s, c in zip(slices, counts):
            if c > 0:
                weights[s] = 1.0 / (c * trained)
    elif normalization == "constant":
        weights[:] = 1.0 / (batch.num_samples * norm_length)
    else:
        raise ValueError(f"unknown trainer.loss.normalization {normalization!r}")
    return (weights * mask).astype(np.float32)


def rank_micro_batches(batch: Batch, rank: int, world: int, *, row_len: int | None, per_micro_batch: int,
                       pad_id: int, weights: np.ndarray) -> list[MicroBatch]:
    """This rank's micro-batches. Packed (row_len set): samples packed into rows of at most
    row_len tokens, `per_micro_batch` rows per micro-batch. Padded (row_len None):
    `per_micro_batch` samples per micro-batch, each padded to the longest.

    Every rank gets the same number of micro-batches: FSDP2's collectives run once per
    forward/backward, so a rank with one micro-batch more than its peers would hang them all.
    """
    lengths = batch.lengths.tolist()
    mine = assign_ranks(lengths, world)
    # Padded keeps the batch's order, as a trainer without packing would see it (sorting by
    # length would pad less, but pack = true is the way to waste nothing).
    rows = [pack(m, lengths, row_len) if row_len is not None else [[i] for i in sorted(m)] for m in mine]
    groups = [[r[i:i + per_micro_batch] for i in range(0, len(r), per_micro_batch)] for r in rows]
    count = max(len(g) for g in groups)
    slices = batch.sample_slices()
    make = _packed if row_len is not None else _padded
    out = [make(batch, slices, group, pad_id, weights) for group in groups[rank]]
    if (table := kept_table(batch)) is not None:
        for mb, group in zip(out, groups[rank]):
            mb.kept = _kept_rows(table, slices, group, mb, packed=row_len is not None)
    if (routing := batch.routing()) is not None:
        for mb, group in zip(out, groups[rank]):
            width = mb.tokens.shape[1]
            mb.routing = _laid_out(routing.astype(np.int64), slices, group, width, 0)
            mb.routed = _laid_out(batch.routed.astype(bool), slices, group, width, False)
    if batch.has_images:
        for mb, group in zip(out, groups[rank]):
            mb.images = [im for row in group for i in row for im in batch.sample_images(i)]
            mb.sampled = _laid_out(batch.token_versions >= 0, slices, group, mb.tokens.shape[1], False)
    # A rank with fewer micro-batches than its peers still joins every collective: padding rows,
    # attended (an all-masked row would give NaN), with nothing to learn from.
    out += [_padding(pad_id, packed=row_len is not None) for _ in range(count - len(out))]
    return out


def kept_table(batch: Batch) -> np.ndarray | None:
    """int32 [tokens, K]: each token's recorded kept ids (rl/batch.py), -1 padded to the largest
    set; None when the batch recorded none."""
    counts = batch.kept_counts.astype(np.int64)
    if not counts.any():
        return None
    table = np.full((len(counts), int(counts.max())), -1, np.int32)
    starts = np.cumsum(counts) - counts
    table[np.repeat(np.arange(len(counts)), counts), np.arange(len(batch.kept_ids)) - np.repeat(starts, counts)] = \
        batch.kept_ids
    return table


def _laid_out(table: np.ndarray, slices: list[slice], rows: list[list[int]], width: int, fill) -> torch.Tensor:
    """A per-token table ([tokens, ...]) as the micro-batch's [R, width, ...], laid out as _packed /
    _padded lay out its tokens (a packed row's samples back to back, then padding: `fill`)."""
    out = torch.full((len(rows), width, *table.shape[1:]), fill, dtype=torch.from_numpy(table[:0]).dtype)
    for r, row in enumerate(rows):
        at = 0
        for i in row:
            n = slices[i].stop - slices[i].start
            out[r, at:at + n] = torch.from_numpy(table[slices[i]])
            at += n
    return out


def _kept_rows(table: np.ndarray, slices: list[slice], rows: list[list[int]], mb: MicroBatch,
               packed: bool) -> torch.Tensor:
    """The micro-batch's [R, T-1, K] kept ids, laid out as its tokens and shifted to the
    predicted token."""
    out = _laid_out(table, slices, rows, mb.tokens.shape[1], -1)[:, 1:]
    if packed:  # the prediction across a sample boundary belongs to no sample
        out = out.masked_fill((mb.position_ids[:, 1:] == 0)[..., None], -1)
    return out


def _fields(batch: Batch, i: int, s: slice, weights: np.ndarray):
    """Sample i's per-token fields (tokens, mask, inference logprobs, advantages, weights,
    temperature, top_k, top_p, min_p), not yet shifted to the predicted token."""
    n = s.stop - s.start
    return (torch.from_numpy(batch.tokens[s]), torch.from_numpy(batch.loss_mask[s].astype(np.float32)),
            torch.from_numpy(batch.logprobs[s]), torch.from_numpy(batch.advantages[s]),
            torch.from_numpy(weights[s]), torch.full((n,), float(batch.temperatures[i])),
            torch.full((n,), int(batch.top_k[i]), dtype=torch.long), torch.full((n,), float(batch.top_p[i])),
            torch.full((n,), float(batch.min_p[i])))


# What a settings field holds where no sample owns the prediction: vLLM's "off".
_SETTINGS_OFF = ((-1, torch.long), (1.0, torch.float32), (0.0, torch.float32))


def _settings_off(shape) -> tuple[torch.Tensor, ...]:
    return tuple(torch.full(shape, v, dtype=d) for v, d in _SETTINGS_OFF)


def _packed(batch: Batch, slices: list[slice], rows: list[list[int]], pad_id: int, weights: np.ndarray) -> MicroBatch:
    """Rows of back-to-back samples, positions restarting at each; a short row is topped up
    with pad tokens that form a sequence of their own (their positions restart too)."""
    width = max(sum(slices[i].stop - slices[i].start for i in row) for row in rows)
    cols = []
    for row in rows:
        parts = [_fields(batch, i, slices[i], weights) for i in row]
        pad = width - sum(len(p[0]) for p in parts)
        tokens, mask, old, adv, w, temp, *settings = (torch.cat(x) for x in zip(*parts))
        positions = torch.cat([torch.arange(len(p[0])) for p in parts] + [torch.arange(pad)])
        seq = torch.cat([torch.full((len(p[0]),), i, dtype=torch.long) for i, p in zip(row, parts)]
                        + [torch.full((pad,), -1, dtype=torch.long)])
        zeros = torch.zeros(pad)
        cols.append((torch.cat([tokens, torch.full((pad,), pad_id, dtype=torch.long)]), positions,
                     *(torch.cat([x, zeros]) for x in (mask, old, adv, w)), seq,
                     torch.cat([temp, torch.ones(pad)]),
                     *(torch.cat([x, off]) for x, off in zip(settings, _settings_off((pad,))))))
    tokens, positions, mask, old, adv, w, seq, temp, *settings = (torch.stack(x) for x in zip(*cols))
    # Shift by one: position t predicts token t+1. The prediction across a sample boundary
    # (last token of one sample -> first token of the next) belongs to no sample: no loss.
    boundary = positions[:, 1:] == 0
    seq = seq[:, 1:].masked_fill(boundary, -1)
    return MicroBatch(tokens, positions, None, mask[:, 1:].masked_fill(boundary, 0.0), old[:, 1:], adv[:, 1:],
                      w[:, 1:].masked_fill(boundary, 0.0), seq, temp[:, 1:].masked_fill(boundary, 1.0),
                      *(x[:, 1:].masked_fill(boundary, v) for x, (v, _) in zip(settings, _SETTINGS_OFF)))


def _padded(batch: Batch, slices: list[slice], rows: list[list[int]], pad_id: int, weights: np.ndarray) -> MicroBatch:
    ids = [i for (i,) in rows]
    width = max(slices[i].stop - slices[i].start for i in ids)
    tokens = torch.full((len(ids), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(ids), width), dtype=torch.long)
    mask, old, adv, w = (torch.zeros((len(ids), width)) for _ in range(4))
    seq = torch.full((len(ids), width), -1, dtype=torch.long)
    temp = torch.ones((len(ids), width))
    settings = _settings_off((len(ids), width))
    for row, i in enumerate(ids):
        t, m, o, a, ww, tt, *ss = _fields(batch, i, slices[i], weights)
        n = len(t)
        tokens[row, :n], attn[row, :n], mask[row, :n], old[row, :n], adv[row, :n], w[row, :n] = t, 1, m, o, a, ww
        seq[row, :n], temp[row, :n] = i, tt
        for into, x in zip(settings, ss):
            into[row, :n] = x
    return MicroBatch(tokens, None, attn, mask[:, 1:], old[:, 1:], adv[:, 1:], w[:, 1:], seq[:, 1:], temp[:, 1:],
                      *(x[:, 1:] for x in settings))


def _padding(pad_id: int, packed: bool) -> MicroBatch:
    z = torch.zeros((1, 1))
    tokens = torch.full((1, 2), pad_id, dtype=torch.long)
    return MicroBatch(tokens, torch.arange(2)[None] if packed else None, None if packed else torch.ones_like(tokens),
                      z, z, z, z, torch.full((1, 1), -1, dtype=torch.long), torch.ones((1, 1)), *_settings_off((1, 1)))
