"""The chunked logprob head (trainer/logprob_head.py) against the plain computation from full
logits: the same values, the same gradients, only loss tokens computed, no [tokens, vocab]
tensor, and models that change their logits after the lm_head refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, Gemma2Config, Qwen2Config

from rl.batch import Batch
from trainer.data import loss_weights, rank_micro_batches
from trainer.logprob_head import LogprobHead, install
from trainer.model import forward_logits, micro_batch_logprobs
from trainer.sampling_mask import NO_TRUNCATION
from samples import single_turn

VOCAB = 512
EPS32 = 2.0 ** -24  # float32 unit roundoff


def random_model(tied: bool, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, tie_word_embeddings=tied, pad_token_id=0,
                      max_position_embeddings=256)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float()


def mixed_batch(seed: int = 0) -> Batch:
    """Samples at different temperatures; some truncated (top_k, top_p, min_p), some not."""
    rng = np.random.default_rng(seed)
    settings = [dict(temperature=1.0), dict(temperature=0.7, top_p=0.8), dict(temperature=1.3, top_k=20),
                dict(temperature=0.9, min_p=0.05)]
    samples = []
    for i in range(10):
        prompt = rng.integers(1, VOCAB, size=int(rng.integers(3, 12))).tolist()
        completion = rng.integers(1, VOCAB, size=int(rng.integers(1, 30))).tolist()
        samples.append(single_turn(prompt, completion, (-rng.random(len(completion))).tolist(),
                                          [0] * len(completion), reward=0.0, advantage=float(rng.normal()),
                                          **settings[i % len(settings)]))
    return Batch.from_samples(1, samples)


def micro_batches(batch: Batch, packed: bool):
    weights = loss_weights(batch, "token", 0)
    return rank_micro_batches(batch, 0, 1, row_len=64 if packed else None, per_micro_batch=3 if packed else 4,
                              pad_id=0, weights=weights)


def logprobs_and_grads(model, mbs, single_row: bool):
    """Per micro-batch (logprobs, entropy, misses) on loss tokens, and the gradient of the
    weighted logprob sum (what the loss backpropagates through) for every parameter."""
    model.zero_grad(set_to_none=True)
    out = []
    for mb in mbs:
        trunc = mb.truncation(VOCAB)
        lp, ent = micro_batch_logprobs(model, mb, torch.device("cpu"), single_row=single_row, truncation=trunc)
        mask = mb.loss_mask > 0
        (lp[mask] * mb.loss_weight[mask]).sum().backward()
        out.append((lp[mask].detach(), ent[mask], trunc.misses))
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return out, grads


def logit_error_bound(model) -> float:
    """Worst-case float32 error of one logit (a dot product of length hidden), times two for
    a logprob (the logit and the log-sum-exp): rows computed in another grouping may differ by
    this much, on any machine."""
    w = model.get_output_embeddings().weight.detach().abs()
    hidden = w.shape[1]
    # Final hidden states are RMS-normalised: sum of squares = hidden before the norm's weight,
    # so no entry exceeds sqrt(hidden) x the largest norm weight.
    h_max = hidden ** 0.5 * float(model.model.norm.weight.detach().abs().max())
    return 2 * hidden * EPS32 * float(w.sum(1).max()) * h_max


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("layout", ["packed", "packed_as_one_row", "padded"])
def test_the_chunked_head_gives_the_plain_values_and_gradients(tied, layout):
    plain = random_model(tied)
    chunked = random_model(tied)
    head = install(chunked, chunk_tokens=5)  # several chunks per micro-batch, a short last one
    assert isinstance(head, LogprobHead) and chunked.get_output_embeddings() is head
    if tied:
        assert head.weight is chunked.get_input_embeddings().weight
    mbs = micro_batches(mixed_batch(), packed=layout != "padded")
    assert any(mb.truncation(VOCAB) is not NO_TRUNCATION for mb in mbs)
    single_row = layout == "packed_as_one_row"
    want, want_grads = logprobs_and_grads(plain, mbs, single_row)
    got, got_grads = logprobs_and_grads(chunked, mbs, single_row)
    bound = logit_error_bound(plain)
    for (lp, ent, misses), (lp_want, ent_want, misses_want) in zip(got, want):
        assert lp.shape == lp_want.shape
        torch.testing.assert_close(lp, lp_want, atol=bound, rtol=0)
        # Entropy is at most log(vocab); its error from the logits' error is bounded the same way.
        torch.testing.assert_close(ent, ent_want, atol=2 * bound, rtol=0)
        assert misses == misses_want
    assert want_grads.keys() == got_grads.keys()
    for name, g in want_grads.items():
        # Sums over up to tokens x vocab terms in another order: normwise relative error n * eps.
        n = sum(int(mb.loss_mask.sum()) for mb in mbs) * VOCAB
        err = float((got_grads[name] - g).norm())
        assert err <= n * EPS32 * float(g.norm()) + 1e-12, f"{name}: gradient differs by {err:.2e}"


def test_label_smoothing_is_torchs_cross_entropy_through_either_head():
    """rl sft's label smoothing: minus the smoothed logprob is torch's cross_entropy(...,
    label_smoothing=0.1) of the same logits, through the plain and the chunked head alike, within
    a logprob's float32 error bound (the smoothing term is a mean of logprobs: the same bound)."""
    cpu = torch.device("cpu")
    plain, chunked = random_model(True), random_model(True)
    install(chunked, chunk_tokens=5)
    bound = logit_error_bound(plain)
    for mb in micro_batches(mixed_batch(), packed=True):
        mask = mb.loss_mask > 0
        logits = forward_logits(plain, mb, cpu, single_row=False)[:, :-1].float() / mb.temperature[..., None]
        want = -torch.nn.functional.cross_entropy(logits[mask], mb.tokens[:, 1:][mask], label_smoothing=0.1,
                                                  reduction="none")
        for model in (plain, chunked):
            got = micro_batch_logprobs(model, mb, cpu, single_row=False, smoothing=0.1)[0][mask]
            torch.testing.assert_close(got.detach(), want.detach(), atol=bound, rtol=0)
        unsmoothed = micro_batch_logprobs(plain, mb, cpu, single_row=False)[0][mask]
        assert float((unsmoothed - want).abs().max()) > 10 * bound  # the smoothing is not lost


class LargestTensor(TorchDispatchMode):
    """The largest tensor any operation produced while active."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def test_no_tensor_grows_with_tokens_times_vocab():
    """The head's forward and backward make nothing larger than one chunk's logits (and the
    weight), while the plain path makes [tokens, vocab]; prompt tokens are not computed."""
    batch = mixed_batch(seed=3)
    mbs = micro_batches(batch, packed=True)
    mb = max(mbs, key=lambda m: int(m.loss_mask.sum()))
    loss_tokens = int(mb.loss_mask.sum())
    chunk = 4
    assert loss_tokens >= 5 * chunk
    sizes = {}
    for name, chunk_tokens in (("plain", 0), ("chunked", chunk)):
        model = random_model(tied=True)
        install(model, chunk_tokens)
        with LargestTensor() as largest:
            lp, _ = micro_batch_logprobs(model, mb, torch.device("cpu"), single_row=False)
            (lp * mb.loss_mask).sum().backward()
        sizes[name] = largest.numel
    assert sizes["plain"] >= mb.tokens.numel() * VOCAB
    assert sizes["chunked"] <= max(chunk * VOCAB, VOCAB * 64)  # a chunk's logits, or the weight itself


def test_a_model_without_a_query_gets_ordinary_logits():
    plain, chunked = random_model(True), random_model(True)
    install(chunked, chunk_tokens=3)
    tokens = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(chunked(input_ids=tokens).logits, plain(input_ids=tokens).logits, rtol=0, atol=0)


def test_a_model_that_soft_caps_its_logits_keeps_the_plain_head(caplog):
    """Gemma2 applies tanh soft-capping after its lm_head: the head's (logprob, entropy) pairs
    would be capped as if they were logits. install notices and leaves the model alone."""
    torch.manual_seed(0)
    cfg = Gemma2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, vocab_size=VOCAB, final_logit_softcapping=30.0)
    model = AutoModelForCausalLM.from_config(cfg)
    original = model.get_output_embeddings()
    assert install(model, chunk_tokens=8) is None
    assert model.get_output_embeddings() is original
    assert "changes its logits after the lm_head" in caplog.text
    cfg.final_logit_softcapping = None
    assert isinstance(install(AutoModelForCausalLM.from_config(cfg), chunk_tokens=8), LogprobHead)


def test_chunk_tokens_zero_keeps_the_plain_head():
    model = random_model(True)
    original = model.get_output_embeddings()
    assert install(model, 0) is None and model.get_output_embeddings() is original
