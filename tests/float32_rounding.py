"""How far float32 rounding may move a logit of the tiny test models (4 layers, widest dot
product 384): the one derivation behind every test that compares a float32 engine or trainer
with a float64 reference. CPUs sum in different orders (an AMD EPYC and an Intel Xeon with AMX
differ in the last bits), so a tolerance comes from here, not from what one machine printed.

A dot product of n terms is off by at most gamma_n * sum |a_i b_i|, gamma_n ~ n u (Higham, in
any order). Charging the widest n to each of the chained matrix products on the path to a
logit, each relative to the scale of the logit's own terms sum_j |E_ij h_j| (to first order,
assuming no layer amplifies an earlier error beyond that scale: every product's input is
RMS-normalised), bounds each logit's error by logit_error(...) * max_i sum_j |E_ij h_j|: a worst
case, far above the ~sqrt(n) u that rounding typically adds up to. A logprob is then off by at
most twice that (log_softmax adds at most max |dlogit| to the logit's own error).

The same analysis gives the bounds for the float32 steps after the logits (gamma,
log_softmax_error, k3_error): a test comparing a float32 computation with an exact (float64)
one allows what these give, and two float32 computations of one value differ by at most the sum.
"""

from __future__ import annotations

import math

U = 2.0 ** -24  # float32 unit roundoff
ULPS = 2  # torch's vectorised exp and log (Sleef's u10 kernels, its own exp_u20) are within 2 ulp = 4 U
LAYERS, WIDEST = 4, 384  # the tiny models' (models/tiny-*/config.json: intermediate_size)


def logit_error(products_per_layer: int) -> float:
    chained = LAYERS * products_per_layer + 1  # then the lm_head
    return chained * WIDEST * U / (1 - chained * WIDEST * U)


def gamma(n: int) -> float:
    """Higham's gamma_n: a float32 sum of n + 1 terms (any order, any grouping) is off by at most
    gamma(n) * the sum of their magnitudes; a product or quotient of exact inputs by U."""
    return n * U / (1 - n * U)


def log_softmax_error(n: int, largest: float) -> float:
    """How far torch's float32 log_softmax over n logits may put an entry from the exact value, when
    the logits are exact float32 numbers whose finite ones are within `largest` in magnitude (-inf,
    masked, adds exactly 0 and only counts in n). torch computes m = max, S = sum exp(x - m),
    out = x - (m + log S) (aten SoftMaxKernel.cpp, _vec_log_softmax_lastdim). To first order:
    x - m rounds by U * 2 * largest, which exp turns into a relative error beside its own
    (ULPS * 2 U); the sum adds gamma(n - 1) relatively; log turns S's relative error into an
    absolute one and adds its own, relative to |log S| <= log n; m + log S and the last
    subtraction round by U times their magnitudes (largest + log n, 2 * largest + log n)."""
    exp_log = 2 * ULPS * U
    s_relative = gamma(n - 1) + 2 * largest * U + exp_log
    log_s = s_relative + exp_log * math.log(n)
    return log_s + U * (largest + math.log(n)) + U * (2 * largest + math.log(n))


def k3_error(x: float) -> float:
    """How far float32 k3(x) = exp(x) - x - 1 (trainer/loss.py's mismatch_kl per token) may be from
    the exact value at the same x: exp's own error, then two subtractions rounding by U times
    their results (|exp(x) - x| and k3 itself, at most exp(x) + |x|)."""
    e = math.exp(x)
    return 2 * ULPS * U * e + 2 * U * (e + abs(x))


LOGIT_ERROR = logit_error(6)  # per layer q/k/v, scores, values, o, gate/up, down: ~5.7e-4
# With LoRA's A then B beside each of q/k/v, o, gate/up, down: 8 per layer, ~7.6e-4 (the larger
# bound the LoRA, sampling-mask and packing tests use).
LORA_LOGIT_ERROR = logit_error(8)


def float64_logprobs(model, ids: list[int], error: float = LOGIT_ERROR):
    """(log_softmax at every position of `ids`, float64 [len(ids), vocab]; per position, how far
    float32 rounding may move any of its logits: `error` * max_i sum_j |E_ij h_j|, h the head's
    input there; a logprob twice that). `model`: a transformers causal LM already in float64, so
    exact to ~1e-16. `error`: LOGIT_ERROR, or logit_error(8) with a LoRA adapter (its A then B
    beside each product)."""
    import torch

    head_in = []
    head = model.get_output_embeddings()
    hook = head.register_forward_hook(lambda m, i, o: head_in.append(i[0][0]))
    try:
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].double(), -1)
            bound = error * (head.weight.abs() @ head_in[0].abs().T).max(0).values
    finally:
        hook.remove()
    return lp, bound


# --- the same analysis in float64 (u = 2^-53), for computations compared in float64 ---------

U64 = 2.0 ** -53
# Chained products on the path to a logit (8 per layer with LoRA, then the lm_head), each a dot
# product of at most WIDEST terms.
CHAINED = LAYERS * 8 + 1


def gamma64(n: int) -> float:
    return n * U64 / (1 - n * U64)


def assert_equal_within_rounding(got: dict, want: dict, chained: int = CHAINED) -> None:
    """Logprobs: each side within 2 x its logits' error of exact (log_softmax adds at most the
    largest), a logit within gamma(chained WIDEST) x max_v sum_j |E_vj h_j| (the reference's own
    head input h: tests/float32_rounding.py's analysis); gradients: each entry a sum over the row's
    tokens of terms through `chained` products forward and back, within gamma(2 chained WIDEST +
    tokens) x tokens x the tensor's largest entry of exact, each side (taking each token's term
    as at most the largest entry: the one assumption beyond the analysis)."""
    mask = want["mask"] > 0
    tokens = int(want["mask"].numel())
    logprob_bound = 2 * 2 * gamma64(chained * WIDEST) * float(want["scale"])
    diff = (got["logprobs"] - want["logprobs"])[mask].abs().max()
    assert diff <= logprob_bound, f"logprobs differ by {diff:.3e} > {logprob_bound:.3e}"
    grads = [k for k in want if k.startswith("grad.")]
    assert grads and set(grads) == {k for k in got if k.startswith("grad.")}
    for k in grads:
        bound = 2 * gamma64(2 * chained * WIDEST + tokens) * tokens * float(want[k].abs().max())
        diff = float((got[k] - want[k]).abs().max())
        assert diff <= bound, f"{k}: gradients differ by {diff:.3e} > {bound:.3e}"


# --- a model's float32 logits and how far another float32 engine's may be from them ---------


def logits_and_gap(model, **inputs) -> tuple:
    """The model's float32 logits [B, T, V] and, per position [B, T], how far another float32
    implementation's logits (the engine's) may differ from them: each is within LORA_LOGIT_ERROR *
    max_v sum_j |E_vj h_j| of the exact ones (LoRA's bound above, h the head's input), so the two within twice that."""
    import torch

    head = model.get_output_embeddings()
    seen = []
    hook = head.register_forward_hook(lambda m, i, o: seen.append(i[0].detach()))
    try:
        with torch.no_grad():
            logits = model(**inputs, use_cache=False).logits
    finally:
        hook.remove()
    scale = (seen[0].abs() @ head.weight.detach().abs().T).amax(-1)
    return logits, 2 * LORA_LOGIT_ERROR * scale


def k3(x):
    """trainer/loss.py's mismatch_kl per token, exp(x) - x - 1 (x a tensor): for |x| <= b at most k3(b)."""
    return x.exp() - x - 1


def kept_bounds(scaled, gap: float, top_k: int, top_p: float) -> tuple:
    """(surely, possibly) bool [V]: the tokens kept by top_k then top_p for every logit vector
    within `gap` of `scaled` (per entry; temperature-scaled, as the sampler sees them), and those
    kept for some. Two tokens' order may flip only if their logits are within 2 * gap; a kept
    token's probability moves by at most a factor e^(2 * gap) (its logit and the normaliser by
    e^gap each), whichever of the possible top-k sets it is normalised over; RHO: float32
    rounding of the masses themselves (a softmax and a cumulative sum over at most the
    candidates: a few units in the last place each)."""
    import torch

    y, g = scaled.double(), float(gap)
    kth = y.topk(top_k).values[-1]
    cand = (y >= kth - 2 * g).nonzero().flatten()  # below that, top_k surely ranks k tokens above
    yc = y[cand]
    surely_above = (y[None, :] > yc[:, None] + 2 * g).sum(1)
    maybe_above = (y[None, :] >= yc[:, None] - 2 * g).sum(1) - 1
    in_k_surely, in_k_maybe = maybe_above < top_k, surely_above < top_k
    w = torch.exp(yc - yc.max())
    low_norm, high_norm = w[in_k_surely].sum(), w[in_k_maybe].sum()
    rho = 2 * (int(in_k_maybe.sum()) + 3) * U
    # Mass ranked strictly above each candidate: at most (anything that may rank above, among
    # the possible top-k, over the smallest normaliser), at least (what surely ranks above, among
    # the sure top-k, over the largest normaliser).
    maybe_before = (yc[None, :] >= yc[:, None] - 2 * g) & ~torch.eye(len(cand), dtype=torch.bool)
    surely_before = yc[None, :] > yc[:, None] + 2 * g
    most = math.exp(2 * g) * (maybe_before & in_k_maybe[None, :]).double() @ w / low_norm + rho
    least = math.exp(-2 * g) * (surely_before & in_k_surely[None, :]).double() @ w / high_norm - rho
    surely, possibly = torch.zeros(len(y), dtype=torch.bool), torch.zeros(len(y), dtype=torch.bool)
    surely[cand] = in_k_surely & (most < top_p)
    possibly[cand] = in_k_maybe & (least < top_p)
    return surely, possibly
