"""Micro-batch planning (trainer/data.py): packing, rank balance, loss weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import TINY_MODEL
from rl.batch import Batch, Sample
from trainer.data import assign_ranks, loss_weights, pack, rank_micro_batches


def variable_batch(seed: int = 0, n: int = 12) -> Batch:
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(n):
        prompt = rng.integers(2, 30, size=int(rng.integers(3, 9))).tolist()
        completion = rng.integers(2, 30, size=int(rng.integers(1, 40))).tolist()
        logprobs = (-rng.random(len(completion))).tolist()
        samples.append(Sample.single_turn(prompt, completion, logprobs, [0] * len(completion),
                                          reward=float(rng.random()), advantage=float(rng.normal())))
    return Batch.from_samples(1, 1.0, samples)


def per_sample_logprobs(model, micro_batches) -> dict[int, torch.Tensor]:
    """Each sample's logprobs of its own tokens (positions 1..len-1), keyed by sample index."""
    out: dict[int, list] = {}
    with torch.no_grad():
        for mb in micro_batches:
            logits = model(input_ids=mb.tokens, position_ids=mb.position_ids, attention_mask=mb.attention_mask,
                           use_cache=False).logits
            logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, mb.tokens[:, 1:, None]).squeeze(-1)
            for row in range(mb.tokens.shape[0]):
                for i in mb.sequence_ids[row].unique().tolist():
                    if i >= 0:
                        out.setdefault(i, []).append(logp[row][mb.sequence_ids[row] == i])
    return {i: torch.cat(v) for i, v in out.items()}


def test_packed_and_padded_forward_give_the_same_per_sample_logprobs():
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32, attn_implementation="sdpa").eval()
    batch = variable_batch()
    w = loss_weights(batch, "token", 0)
    packed = rank_micro_batches(batch, 0, 1, row_len=64, per_micro_batch=2, pad_id=0, weights=w)
    padded = rank_micro_batches(batch, 0, 1, row_len=None, per_micro_batch=4, pad_id=0, weights=w)
    assert all(mb.tokens.shape[0] <= 2 and mb.tokens.shape[1] <= 64 for mb in packed)
    assert sum(mb.tokens.shape[0] for mb in packed) < batch.num_samples  # several samples share a row
    assert any(mb.tokens.shape[0] == 2 for mb in packed)  # and rows of different fill share a micro-batch
    a, b = per_sample_logprobs(model, packed), per_sample_logprobs(model, padded)
    assert sorted(a) == sorted(b) == list(range(batch.num_samples))
    # A forward pass only: the layouts change the shapes of the matrix products and the lengths
    # of attention's sums, so logprobs agree to float32 rounding, whatever the CPU's kernels
    # (measured: < 2e-6 under AVX2 and AVX-512 MKL and ATen kernels). Attention leaking across
    # packed samples moves them by ~1 (2.2 here).
    for i in a:
        assert len(a[i]) == len(b[i]) == int(batch.lengths[i]) - 1
        torch.testing.assert_close(a[i], b[i], atol=1e-5, rtol=1e-5)
    # And the trained-on values travel with their tokens in both layouts.
    for key in ("loss_mask", "advantages", "inference_logprobs", "loss_weight"):
        assert sum(float(getattr(mb, key).sum()) for mb in packed) == pytest.approx(
            sum(float(getattr(mb, key).sum()) for mb in padded), rel=1e-6)


def test_first_fit_decreasing_respects_the_budget_and_keeps_every_sample():
    lengths = [50, 10, 30, 60, 5, 25, 64, 1, 33]
    bins = pack(list(range(len(lengths))), lengths, budget=64)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 64 for b in bins)
    # FFD on these: [64], [60, 1], [50, 10], [33, 30], [25, 5] -> 5 bins (the lower bound is 5).
    assert len(bins) == 5


def test_ranks_get_balanced_tokens():
    lengths = [100, 90, 80, 10, 10, 10, 5, 5]
    a, b = assign_ranks(lengths, 2)
    la, lb = sum(lengths[i] for i in a), sum(lengths[i] for i in b)
    # The best split is 140 vs 170 (every subset with 100 and 80 or 90 is too big).
    assert abs(la - lb) == 30 and sorted(a + b) == list(range(8))


@pytest.mark.parametrize("packed", [True, False])
def test_ranks_get_equal_micro_batch_counts_even_with_odd_sample_counts(packed):
    """Sample counts vary (failed rollouts leave groups smaller): every rank must still run the
    same number of forward/backward passes, padding-only ones included, or FSDP2 hangs."""
    for samples, world, mbs in [(5, 2, 1), (7, 4, 1), (9, 2, 2), (3, 2, 4), (1, 2, 1), (3, 8, 2)]:
        batch = Batch.from_samples(1, 1.0, [Sample.single_turn([5, 6], [7], [-1.0], [0], 1.0, 0.5)] * samples)
        w = loss_weights(batch, "token", 0)
        per_rank = [rank_micro_batches(batch, r, world, row_len=3 if packed else None,
                                       per_micro_batch=mbs, pad_id=0, weights=w) for r in range(world)]
        assert len({len(p) for p in per_rank}) == 1, (samples, world, mbs)
        trained = sum(int(mb.loss_mask.sum()) for p in per_rank for mb in p)
        assert trained == samples  # each sample's one completion token, once; padding adds none
        assert sum(float(mb.loss_weight.sum()) for p in per_rank for mb in p) == pytest.approx(1.0)


def test_loss_weights_by_normalisation():
    # Two samples: 1 and 3 loss tokens.
    batch = Batch.from_samples(1, 1.0, [Sample.single_turn([5], [7], [-1.0], [0], 1.0, 0.5),
                                        Sample.single_turn([5], [7, 8, 9], [-1.0] * 3, [0] * 3, 1.0, 0.5)])
    mask = batch.loss_mask.astype(bool)
    assert loss_weights(batch, "token", 0)[mask].tolist() == pytest.approx([0.25] * 4)
    assert loss_weights(batch, "sequence", 0)[mask].tolist() == pytest.approx([0.5] + [1 / 6] * 3)
    assert loss_weights(batch, "constant", 10)[mask].tolist() == pytest.approx([0.05] * 4)
    assert loss_weights(batch, "token", 0)[~mask].tolist() == [0.0, 0.0]


def test_packed_rows_as_one_row_give_the_same_logits():
    """The flash-attention path feeds a micro-batch's packed rows as one row (transformers finds
    varlen boundaries only in a single row); positions restart per sample, so attention must
    still stay inside each sample. Checked here with sdpa, which honours the same positions."""
    from trainer.main import forward_logits

    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32, attn_implementation="sdpa").eval()
    batch = variable_batch(seed=1)
    mbs = rank_micro_batches(batch, 0, 1, row_len=48, per_micro_batch=3, pad_id=0, weights=loss_weights(batch, "token", 0))
    assert any(mb.tokens.shape[0] == 3 for mb in mbs)
    shapes = []
    model.register_forward_pre_hook(lambda m, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)),
                                    with_kwargs=True)
    with torch.no_grad():
        for mb in mbs:
            rows = forward_logits(model, mb, torch.device("cpu"), single_row=False)
            one = forward_logits(model, mb, torch.device("cpu"), single_row=True)
            assert shapes[-2:] == [tuple(mb.tokens.shape), (1, mb.tokens.numel())]
            assert one.shape == rows.shape
            real = mb.tokens != 0  # padding tails may differ; they carry no loss
            # Float32 rounding of other shapes only, as above (measured: < 2e-6).
            torch.testing.assert_close(one[real], rows[real], atol=1e-5, rtol=1e-5)


def test_a_sample_whose_first_token_is_trained_weighs_the_same_packed_or_padded():
    """A sample's first token has no prediction; packed, the position before it is the previous
    sample's last token, which must not train on it either."""
    samples = [Sample.single_turn([], [7, 8, 9], [-1.0] * 3, [0] * 3, 1.0, 0.5),
               Sample.single_turn([], [4, 5], [-1.0] * 2, [0] * 2, 1.0, 0.5)]
    batch = Batch.from_samples(1, 1.0, samples)
    w = loss_weights(batch, "token", 0)
    assert w.tolist() == pytest.approx([0, 1 / 3, 1 / 3, 0, 1 / 3])
    packed = rank_micro_batches(batch, 0, 1, row_len=16, per_micro_batch=1, pad_id=0, weights=w)
    padded = rank_micro_batches(batch, 0, 1, row_len=None, per_micro_batch=2, pad_id=0, weights=w)
    for mbs in (packed, padded):
        assert sum(float(mb.loss_weight.sum()) for mb in mbs) == pytest.approx(1.0)
        assert sum(float(mb.loss_mask.sum()) for mb in mbs) == 3
