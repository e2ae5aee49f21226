"""Keep Sampling Mask: the trainer's logprobs over the tokens the sampler actually kept.

With top_k, top_p or min_p the engine samples from a truncated, renormalised distribution, and
reports that distribution's logprob (`--logprobs-mode processed_logprobs`: vLLM 0.32 takes them
after temperature, min_p, top_k and top_p, vllm/v1/sample/ops/topk_topp_sampler.py
`forward_cpu`/`forward_native`). A trainer that normalises over the whole vocabulary compares
two different distributions: the importance ratio and the KL are biased by log(kept mass).

vLLM does not report the kept set itself (only the top `max_logprobs` processed logprobs, or the
whole vocabulary per token), so the batch carries what rebuilds it: each sample's temperature,
top_k, top_p and min_p (batch format v3). The trainer applies vLLM's own steps, in vLLM's order,
to its own temperature-scaled float32 logits, and renormalises over what is kept. On
policy the two logit vectors agree to float32 rounding, so the sets agree except where a token
sits on a boundary within rounding; off policy the set is the current policy's. The sampled
token is always kept (the sampler drew it, so it was in its set): a token the rebuilt set left
out is added back and counted (`sampling_mask_miss_frac`).

Replay (`orchestrator.record_kept_sets`): the engine reports each token's kept set itself, read
off its processed logprobs (inference/kept_sets.py), and the batch carries it (rl/batch.py
`kept_counts`, `kept_ids`). Where a token has one, the trainer renormalises over exactly it, the
sampler's own set, however stale the sample; the rebuild stays for tokens without one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

# Rows of [rows, vocab] processed at once: bounds the no-grad temporaries (a few float32 and
# bool copies) to a few hundred MB whatever the vocabulary.
_CHUNK_ENTRIES = 1 << 24


@dataclass
class Truncation:
    """Per predicted token ([R, T-1], as MicroBatch.temperature): the sampler's settings and
    which tokens to renormalise (`select`: truncated samples' loss tokens). `misses` is filled
    in by token_logprobs_and_entropy: sampled tokens the rebuilt kept set did not contain.
    NoTruncation stands in where nothing is truncated."""

    top_k: Tensor  # int64; <= 0 or >= vocab: off
    top_p: Tensor  # float32; 1: off
    min_p: Tensor  # float32; 0: off
    select: Tensor  # bool
    kept: Tensor | None = None  # int [..., K]: the sampler's kept ids, -1 padded; none: rebuild
    misses: float = 0.0
    replayed: float = 0.0  # selected positions renormalised over a replayed set

    def mapped(self, fn: Callable[[Tensor, int | float | bool], Tensor]) -> Truncation:
        """fn(field, its "off" value) applied to each per-token field (e.g. padded, moved)."""
        return Truncation(fn(self.top_k, -1), fn(self.top_p, 1.0), fn(self.min_p, 0.0), fn(self.select, False),
                          None if self.kept is None else fn(self.kept, -1))

    def rows(self, index: Tensor | slice) -> Truncation:
        """The positions `index` picks from the flattened per-token fields (kept keeps its last dim)."""
        return Truncation(*(x.reshape(-1)[index] for x in (self.top_k, self.top_p, self.min_p, self.select)),
                          kept=None if self.kept is None else self.kept.reshape(-1, self.kept.shape[-1])[index])

    def renormalise(self, scaled: Tensor, tokens: Tensor, logprobs: Tensor,
                    entropy: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(logprobs, entropy, float32 [misses, replayed]): the full-vocabulary logprobs and
        entropy (scaled's leading dims, tokens the predicted ids) with the selected positions'
        recomputed over their kept sets. `select` is tested before it moves: the loss path's is
        the host's copy, so asking costs no wait for the device."""
        if not bool(self.select.any()):
            return logprobs, entropy, logprobs.new_zeros(2)
        sel = self.select.to(scaled.device)
        at = [x.to(scaled.device)[sel] for x in (self.top_k, self.top_p, self.min_p)]
        kept = None if self.kept is None else self.kept.to(scaled.device)[sel]
        lp, ent, misses, replayed = renormalised(scaled[sel], tokens[sel], Truncation(*at, select=sel, kept=kept))
        # Out-of-place index_put: the full-vocabulary values elsewhere keep their gradient.
        where = sel.nonzero(as_tuple=True)
        return (logprobs.index_put(where, lp), entropy.index_put(where, ent),
                torch.stack([misses, replayed]).float())

    def counted(self, counts: Tensor) -> None:
        """Keep a forward's [misses, replayed] (read now: the host waits for the device)."""
        self.misses, self.replayed = counts.tolist()

    def sums(self) -> list[float]:
        """[selected positions, misses, replayed]: what the step adds up over micro-batches."""
        return [float(self.select.sum()), self.misses, self.replayed]


class NoTruncation:
    """A batch (or a setting) without truncation: every position keeps the full-vocabulary
    logprob. Callers use it as they use Truncation, without asking; it builds no per-token
    tensor and reads nothing back from the device, so an untruncated step pays nothing for the mask."""

    misses = 0.0
    replayed = 0.0

    def mapped(self, fn: Callable[[Tensor, int | float | bool], Tensor]) -> NoTruncation:
        return self

    def rows(self, index: Tensor | slice) -> NoTruncation:
        return self

    def renormalise(self, scaled: Tensor, tokens: Tensor, logprobs: Tensor,
                    entropy: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return logprobs, entropy, logprobs.new_zeros(2)

    def counted(self, counts: Tensor) -> None:
        pass

    def sums(self) -> list[float]:
        return [0.0, 0.0, 0.0]


# Stateless, so one instance serves every caller (and default arguments).
NO_TRUNCATION = NoTruncation()


def is_truncated(top_k: Tensor, top_p: Tensor, min_p: Tensor, vocab: int) -> Tensor:
    """Where sampling kept less than the whole vocabulary (vLLM's own "is this on" tests)."""
    return ((top_k > 0) & (top_k < vocab)) | (top_p < 1) | (min_p > 0)


@torch.no_grad()
def kept_mask(scaled: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor) -> Tensor:
    """bool [N, V]: the tokens vLLM keeps for temperature-scaled float32 logits [N, V], row by
    row with its own settings. Chunked over rows to bound the temporaries."""
    rows = max(1, _CHUNK_ENTRIES // scaled.shape[-1])
    return torch.cat([_kept_rows(scaled[i:i + rows], top_k[i:i + rows], top_p[i:i + rows], min_p[i:i + rows])
                      for i in range(0, scaled.shape[0], rows)]) if scaled.shape[0] else scaled.bool()


def _kept_rows(scaled: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor) -> Tensor:
    # vLLM 0.32's steps in its order: MinPLogitsProcessor.apply (v1/sample/logits_processor/
    # builtin.py, after temperature), then apply_top_k_top_p_pytorch (v1/sample/ops/
    # topk_topp_sampler.py): top-k on the logits, top-p on the softmax of what top-k left
    # (vLLM drops a token when the ascending cumulative mass up to it is <= 1 - p, i.e. keeps
    # it when the mass ranked strictly above it is < p). vLLM sorts the whole vocabulary; here
    # topk over the few candidates that matter gives the same sets (10x cheaper at 152k).
    x = scaled.float().clone()
    vocab = x.shape[-1]
    if bool((min_p > 0).any()):
        probs = x.softmax(-1)
        x.masked_fill_(probs < probs.amax(-1, keepdim=True) * min_p[:, None], float("-inf"))
    on_k = (top_k > 0) & (top_k < vocab)
    if bool(on_k.any()):
        k = torch.where(on_k, top_k, 1)
        kth = x.topk(int(k.max()), -1).values.gather(1, (k - 1).long()[:, None])
        x.masked_fill_((x < kth) & on_k[:, None], float("-inf"))
    keep = x > float("-inf")
    on_p = top_p < 1
    if bool(on_p.any()):
        keep = torch.where(on_p[:, None], _top_p(x.softmax(-1), top_p, on_p), keep)
    return keep


def _top_p(probs: Tensor, top_p: Tensor, on_p: Tensor) -> Tensor:
    """Top-p's kept set from the top m tokens per row, m growing until they hold mass p in
    every row where top_p is on: tokens beyond them have at least p ranked above and are out."""
    vocab = probs.shape[-1]
    m = min(vocab, 64)
    while True:
        values, index = probs.topk(m, -1)
        if m == vocab or bool((values.sum(-1)[on_p] >= top_p[on_p]).all()):
            break
        m = min(vocab, 4 * m)
    above = values.cumsum(-1) - values
    kept = (above < top_p[:, None]) & (values > 0)
    return torch.zeros_like(probs, dtype=torch.bool).scatter_(1, index, kept)


def kept_sets(scaled: Tensor, trunc: Truncation) -> tuple[Tensor, Tensor]:
    """(bool [n, V] kept sets, how many were replayed) for the selected positions' scaled logits:
    the sampler's recorded set where there is one, else rebuilt from the settings."""
    if trunc.kept is None:
        return kept_mask(scaled, trunc.top_k, trunc.top_p, trunc.min_p), scaled.new_zeros((), dtype=torch.long)
    n, vocab = scaled.shape
    has = (trunc.kept >= 0).any(-1)
    # Padding (-1) goes to a column past the vocabulary, dropped after: scattering it onto a real
    # id would race with that id's own True (scatter's order among duplicates is undefined).
    ids = torch.where((trunc.kept >= 0) & (trunc.kept < vocab), trunc.kept, vocab).long()
    keep = torch.zeros(n, vocab + 1, dtype=torch.bool, device=scaled.device).scatter_(1, ids, True)[:, :vocab]
    if not bool(has.all()):
        rest = ~has
        keep[rest] = kept_mask(scaled[rest], trunc.top_k[rest], trunc.top_p[rest], trunc.min_p[rest])
    return keep, has.sum()


def renormalised(scaled: Tensor, tokens: Tensor, trunc: Truncation) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(logprobs, entropy, misses, replayed) of the selected positions: scaled [n, V] (differentiable),
    tokens [n]; settings already gathered to [n]. Logits outside the kept set become -inf, so
    they get no gradient and no probability."""
    keep, replayed = kept_sets(scaled.detach(), trunc)
    sampled = torch.zeros_like(keep).scatter_(1, tokens[:, None], True)
    misses = (sampled & ~keep).sum()
    keep |= sampled
    logp = torch.log_softmax(scaled.masked_fill(~keep, float("-inf")), dim=-1)
    with torch.no_grad():
        # where(): 0 * -inf would be NaN off the kept set.
        entropy = -torch.where(keep, logp.exp() * logp, 0.0).sum(-1)
    return logp.gather(-1, tokens[:, None]).squeeze(-1), entropy, misses, replayed
