"""The sampler's kept set per token, read off its processed logprobs (GenerateRequest.kept_sets).

vLLM samples from logits truncated by min_p, top_k and top_p, and with `--logprobs-mode
processed_logprobs` the logprobs it reports are taken after that truncation: every token outside
the kept set has logprob -inf. Asking for the top N logprobs of each sampled token therefore
returns the kept set itself, whole, as long as N is larger than the set can be: top_k + 1 when
top_k is on (the extra one shows where the set ends), else the whole vocabulary. That N is
bounded by the server's --max-logprobs (inference.max_logprobs); a request needing more is
refused. The cost is N logprobs per token, computed on the engine's already processed logits
(a top-N over the vocabulary, then N Python objects per token in the output processor).

vLLM 0.32's own sampling-mask output (`return_sampling_mask`, CompletionOutput.sampling_mask)
needs its V2 model runner, which runs on Triton, which the CPU build lacks: docs/trainer.md.
A set can still come back larger than N when ties at the k-th logit keep more than k tokens;
then all N are finite and the token is recorded with no set (the trainer rebuilds it).
"""

from __future__ import annotations

import math


def kept_sets(logprobs: list[dict], asked: int, vocab: int) -> list[list[int]]:
    """Per sampled token (vLLM's CompletionOutput.logprobs: token id -> Logprob, the top `asked`
    and the sampled one), the ids with a finite logprob, ascending; [] where the set may extend
    past the `asked` returned (none of them -inf, and fewer than the whole vocabulary)."""
    out = []
    for d in logprobs:
        top = [(t, lp.logprob) for t, lp in d.items() if lp.rank is not None and lp.rank <= asked]
        kept = sorted(t for t, lp in d.items() if lp.logprob > -math.inf)
        complete = asked >= vocab or any(v == -math.inf for _, v in top)
        out.append(kept if complete else [])
    return out
