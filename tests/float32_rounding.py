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
"""

from __future__ import annotations

U = 2.0 ** -24  # float32 unit roundoff
LAYERS, WIDEST = 4, 384  # the tiny models' (models/tiny-*/config.json: intermediate_size)


def logit_error(products_per_layer: int) -> float:
    chained = LAYERS * products_per_layer + 1  # then the lm_head
    return chained * WIDEST * U / (1 - chained * WIDEST * U)


LOGIT_ERROR = logit_error(6)  # per layer q/k/v, scores, values, o, gate/up, down: ~5.7e-4


def float64_logprobs(model, ids: list[int]):
    """(log_softmax at every position of `ids`, float64 [len(ids), vocab]; per position, how far
    float32 rounding may move any of its logits: LOGIT_ERROR * max_i sum_j |E_ij h_j|, h the
    head's input there). `model`: a transformers causal LM already in float64, so exact to ~1e-16."""
    import torch

    head_in = []
    head = model.get_output_embeddings()
    hook = head.register_forward_hook(lambda m, i, o: head_in.append(i[0][0]))
    try:
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].double(), -1)
            bound = LOGIT_ERROR * (head.weight.abs() @ head_in[0].abs().T).max(0).values
    finally:
        hook.remove()
    return lp, bound
