"""Per-token logprobs and entropy from the last hidden states, without [tokens, vocab] logits.

At a 151,936-token vocabulary, float32 logits for 8k tokens are ~5 GB, and the log-softmax, its
exp and the backward each add a copy of that size. But the loss needs one logprob per loss token
(a completion's, not a prompt's), and each needs one row of logits at a time. LogprobHead
computes them `chunk_tokens` rows at a time, and only where asked; the backward pass rebuilds
each chunk's logits (activation checkpointing of the head), so peak memory grows with the chunk,
not with tokens x vocab, for one more [chunk, hidden] x [hidden, vocab] matmul per chunk.

Why a replacement `lm_head` rather than a function called after the model: under FSDP2 the
root's weights (embeddings, tied lm_head) are gathered only inside the root module's forward, so
the computation runs inside it. `install` puts the head in place of the model's lm_head before
sharding, sharing its weight (tied embeddings stay tied, state-dict names stay the same). Without
a query the head returns ordinary logits; with one (`LogprobHead.asked`) it returns
[..., 2] = (logprob, entropy) where the model would have returned logits. A model that changes
the logits after its lm_head (soft-capping, scaling) would corrupt that: `install` checks on a
probe that the model hands the head's output back untouched, and keeps the plain lm_head if not.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from trainer.sampling_mask import NO_TRUNCATION, NoTruncation, Truncation

log = logging.getLogger("trainer")


@dataclass
class TokenQuery:
    """What the head computes instead of logits, one entry per position of the model's input
    (flattened, in the order the model sees them)."""

    targets: Tensor  # int64: the token the position predicts (any id where not wanted)
    wanted: Tensor  # bool: positions whose logprob is needed
    temperature: Tensor  # float32: the logits are divided by it (the sampler's temperature)
    truncation: Truncation | NoTruncation = NO_TRUNCATION  # same layout; its `select` within `wanted`
    smoothing: float = 0.0  # label smoothing (rl sft): trainer/loss.py token_logprobs_and_entropy
    # wanted's flat indices, found on the host (trainer/model.py micro_batch_query); None: here
    where: Tensor | None = None


class LogprobHead(nn.Module):
    """The model's lm_head, able to answer a TokenQuery in chunks (module docstring)."""

    def __init__(self, linear: nn.Linear, chunk_tokens: int):
        super().__init__()
        # The same Parameter objects: a tied lm_head stays the embedding's weight.
        self.weight = linear.weight
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.chunk_tokens = chunk_tokens
        self.query: TokenQuery | None = None
        # [misses, replayed] of the last query, kept on the device until read (misses: sampled
        # tokens the kept sets lacked; replayed: positions renormalised over the sampler's
        # recorded set): a query without truncation never reads them, and never waits for them.
        self.counts = torch.zeros(2)

    @contextmanager
    def asked(self, query: TokenQuery):
        self.query = query
        try:
            yield
        finally:
            self.query = None

    def forward(self, hidden: Tensor) -> Tensor:
        if self.query is None:
            return F.linear(hidden, self.weight, self.bias)
        q = self.query
        flat = hidden.reshape(-1, hidden.shape[-1])
        if q.wanted.numel() != flat.shape[0]:
            raise ValueError(f"query for {q.wanted.numel()} positions, the model gave {flat.shape[0]}")
        where = q.where if q.where is not None else q.wanted.reshape(-1).nonzero().squeeze(1)
        # A micro-batch without wanted positions (a rank's padding pass) still runs one position,
        # times zero: every rank must produce a gradient for the head's weight, or FSDP2's
        # reduce-scatter would pair different parameter sets across ranks.
        empty = where.numel() == 0
        if empty:
            where = where.new_zeros(1)
        trunc = q.truncation.rows(where)
        h, targets, temperature = flat[where], q.targets.reshape(-1)[where], q.temperature.reshape(-1)[where]
        # Rebuild each chunk in the backward only when something needs its gradient.
        rebuild = torch.is_grad_enabled() and (h.requires_grad or self.weight.requires_grad)
        logprobs, entropies, counts = [], [], torch.zeros(2, device=flat.device)  # misses, replayed
        for i in range(0, h.shape[0], self.chunk_tokens):
            part = slice(i, i + self.chunk_tokens)
            args = (h[part], self.weight, self.bias, targets[part], temperature[part], trunc.rows(part), q.smoothing)
            lp, ent, count = checkpoint(_chunk, *args, use_reentrant=False) if rebuild else _chunk(*args)
            logprobs.append(lp)
            entropies.append(ent)
            counts = counts + count
        self.counts = counts.detach()
        values = torch.stack([torch.cat(logprobs), torch.cat(entropies)], -1)
        out = flat.new_zeros(flat.shape[0], 2, dtype=torch.float32).index_put((where,), values * 0 if empty else values)
        # A copy, not a view: FSDP2 warns that an in-place op on a view its root returns would
        # skip its pre-backward hook ([tokens, 2] floats: nothing to copy).
        return out.reshape(*hidden.shape[:-1], 2).clone()


def _chunk(h: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, temperature: Tensor,
           truncation: Truncation | NoTruncation, smoothing: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """(logprob, entropy, [misses, replayed]) of one chunk's positions: the same arithmetic as
    trainer/loss.py token_logprobs_and_entropy on the same rows (float32 after the matmul)."""
    scaled = F.linear(h, weight, bias).float() / temperature[:, None]
    logp_all = torch.log_softmax(scaled, dim=-1)
    logprobs = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    if smoothing:
        logprobs = (1 - smoothing) * logprobs + smoothing * logp_all.mean(-1)
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return truncation.renormalise(scaled, targets, logprobs, entropy)


def install(model: nn.Module, chunk_tokens: int) -> LogprobHead | None:
    """Replace the model's lm_head with a LogprobHead (before sharding), if the model returns
    its lm_head's output unchanged; else leave the model as it was and say so."""
    linear = model.get_output_embeddings()
    if chunk_tokens <= 0 or not isinstance(linear, nn.Linear):
        return None
    head = LogprobHead(linear, chunk_tokens)
    model.set_output_embeddings(head)
    if _probe_agrees(model, head):
        return head
    model.set_output_embeddings(linear)
    log.warning("trainer.model.logits_chunk_tokens: %s changes its logits after the lm_head; computing full "
                "logits instead (more memory at large vocabularies)", type(model).__name__)
    return None


@torch.no_grad()
def _probe_agrees(model: nn.Module, head: LogprobHead) -> bool:
    """Whether the model returns exactly the tensor its head returned, for a query on a few
    tokens. A structural test rather than a numeric one: on a freshly initialised model the
    logits are small, where a soft-cap (c * tanh(x / c)) is nearly the identity."""
    device = head.weight.device
    tokens = torch.zeros(1, 4, dtype=torch.long, device=device)
    query = TokenQuery(tokens, torch.ones_like(tokens, dtype=torch.bool), torch.ones(tokens.shape, device=device))
    seen = []
    hook = head.register_forward_hook(lambda module, args, out: seen.append(out))
    try:
        with head.asked(query):
            got = model(input_ids=tokens, use_cache=False).logits
    finally:
        hook.remove()
    return len(seen) == 1 and got is seen[0]
