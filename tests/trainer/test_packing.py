"""Micro-batch planning (trainer/data.py): packing, rank balance, loss weights, per-sample
temperatures; and the batch's per-sample sampling settings on the wire (rl/batch.py)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import TINY_MODEL
from rl.batch import Batch, BatchError, Sample
from trainer.data import assign_ranks, loss_weights, pack, rank_micro_batches
from trainer.loss import token_logprobs_and_entropy
from samples import single_turn, variable_batch


def sample_gap(model, batch: Batch, i: int) -> torch.Tensor:
    """How far float32 rounding may move sample i's logits between two layouts (any shapes, any
    kernels), per predicting position [len - 1]: tests/trainer/test_sampling_mask.py logits_and_gap (each
    layout within LOGIT_ERROR * the scale of a logit's terms of the exact value, so the two
    within twice that). A logprob moves by at most twice that (its logit and the normaliser)."""
    from float32_rounding import logits_and_gap

    tokens = torch.from_numpy(batch.tokens[batch.sample_slices()[i]])[None]
    return logits_and_gap(model, input_ids=tokens)[1][0, :-1]


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
    # of attention's sums, so logprobs agree to float32 rounding, whatever the CPU's kernels:
    # within twice sample_gap (a worst case, ~1e-2 here; typically < 2e-6). Attention leaking
    # across packed samples moves them by ~1 (2.2 here).
    for i in a:
        assert len(a[i]) == len(b[i]) == int(batch.lengths[i]) - 1
        bound = 2 * sample_gap(model, batch, i)
        assert ((a[i] - b[i]).abs() <= bound).all(), ((a[i] - b[i]).abs() - bound).max()
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
        batch = Batch.from_samples(1, [single_turn([5, 6], [7], [-1.0], [0], 1.0, 0.5)] * samples)
        w = loss_weights(batch, "token", 0)
        per_rank = [rank_micro_batches(batch, r, world, row_len=3 if packed else None,
                                       per_micro_batch=mbs, pad_id=0, weights=w) for r in range(world)]
        assert len({len(p) for p in per_rank}) == 1, (samples, world, mbs)
        trained = sum(int(mb.loss_mask.sum()) for p in per_rank for mb in p)
        assert trained == samples  # each sample's one completion token, once; padding adds none
        assert sum(float(mb.loss_weight.sum()) for p in per_rank for mb in p) == pytest.approx(1.0)


def test_loss_weights_by_normalisation():
    # Two samples: 1 and 3 loss tokens.
    batch = Batch.from_samples(1, [single_turn([5], [7], [-1.0], [0], 1.0, 0.5),
                                   single_turn([5], [7, 8, 9], [-1.0] * 3, [0] * 3, 1.0, 0.5)])
    mask = batch.loss_mask.astype(bool)
    assert loss_weights(batch, "token", 0)[mask].tolist() == pytest.approx([0.25] * 4)
    assert loss_weights(batch, "sequence", 0)[mask].tolist() == pytest.approx([0.5] + [1 / 6] * 3)
    assert loss_weights(batch, "constant", 10)[mask].tolist() == pytest.approx([0.05] * 4)
    assert loss_weights(batch, "token", 0)[~mask].tolist() == [0.0, 0.0]


def test_packed_rows_as_one_row_give_the_same_logits():
    """The flash-attention path feeds a micro-batch's packed rows as one row (transformers finds
    varlen boundaries only in a single row); positions restart per sample, so attention must
    still stay inside each sample. Checked here with sdpa, which honours the same positions."""
    from trainer.model import forward_logits

    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32, attn_implementation="sdpa").eval()
    batch = variable_batch(seed=1)
    mbs = rank_micro_batches(batch, 0, 1, row_len=48, per_micro_batch=3, pad_id=0, weights=loss_weights(batch, "token", 0))
    assert any(mb.tokens.shape[0] == 3 for mb in mbs)
    shapes = []
    model.register_forward_pre_hook(lambda m, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)),
                                    with_kwargs=True)
    from float32_rounding import LORA_LOGIT_ERROR as LOGIT_ERROR

    head = model.get_output_embeddings()
    head_in = []
    head.register_forward_hook(lambda m, i, o: head_in.append(i[0]))
    with torch.no_grad():
        for mb in mbs:
            rows = forward_logits(model, mb, torch.device("cpu"), single_row=False)
            one = forward_logits(model, mb, torch.device("cpu"), single_row=True)
            assert shapes[-2:] == [tuple(mb.tokens.shape), (1, mb.tokens.numel())]
            assert one.shape == rows.shape
            real = mb.tokens != 0  # padding tails may differ; they carry no loss
            # Float32 rounding of other shapes only, as above: each logit within twice
            # LOGIT_ERROR * the scale of its terms (sample_gap; h: the rows' head input).
            gap = 2 * LOGIT_ERROR * (head_in[-2].abs() @ head.weight.abs().T).amax(-1)
            assert ((one - rows).abs()[real] <= gap[real][:, None]).all()


def test_a_sample_whose_first_token_is_trained_weighs_the_same_packed_or_padded():
    """A sample's first token has no prediction; packed, the position before it is the previous
    sample's last token, which must not train on it either."""
    samples = [single_turn([], [7, 8, 9], [-1.0] * 3, [0] * 3, 1.0, 0.5),
               single_turn([], [4, 5], [-1.0] * 2, [0] * 2, 1.0, 0.5)]
    batch = Batch.from_samples(1, samples)
    w = loss_weights(batch, "token", 0)
    assert w.tolist() == pytest.approx([0, 1 / 3, 1 / 3, 0, 1 / 3])
    packed = rank_micro_batches(batch, 0, 1, row_len=16, per_micro_batch=1, pad_id=0, weights=w)
    padded = rank_micro_batches(batch, 0, 1, row_len=None, per_micro_batch=2, pad_id=0, weights=w)
    for mbs in (packed, padded):
        assert sum(float(mb.loss_weight.sum()) for mb in mbs) == pytest.approx(1.0)
        assert sum(float(mb.loss_mask.sum()) for mb in mbs) == 3


@pytest.mark.parametrize("layout", ["packed", "packed_as_one_row", "padded"])
def test_each_sample_is_scored_at_its_own_temperature(layout):
    """A batch mixing samples drawn at different temperatures: through the trainer's path
    (micro-batches -> micro_batch_logprobs), each sample's logprobs and entropies equal those of
    the sample forwarded alone at its own scalar temperature."""
    from trainer.model import micro_batch_logprobs

    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32, attn_implementation="sdpa").eval()
    temps = [0.5, 1.3, 1.0, 0.8]
    batch = variable_batch(seed=2, n=10, temperatures=temps)
    w = loss_weights(batch, "token", 0)
    mbs = rank_micro_batches(batch, 0, 1, row_len=None if layout == "padded" else 64, per_micro_batch=2,
                             pad_id=0, weights=w)
    got: dict[int, list] = {}
    mixed_rows = 0
    with torch.no_grad():
        for mb in mbs:
            assert mb.temperature.shape == mb.loss_mask.shape
            # Predictions no sample owns (padding, packed-sample boundaries) stay at 1.0.
            assert (mb.temperature[mb.sequence_ids < 0] == 1.0).all()
            lp, ent = micro_batch_logprobs(model, mb, torch.device("cpu"), single_row=layout == "packed_as_one_row")
            for row in range(mb.tokens.shape[0]):
                ids = [i for i in mb.sequence_ids[row].unique().tolist() if i >= 0]
                mixed_rows += len({temps[i % len(temps)] for i in ids}) > 1
                for i in ids:
                    sel = mb.sequence_ids[row] == i
                    assert (mb.temperature[row][sel] == temps[i % len(temps)]).all()
                    got.setdefault(i, []).append((lp[row][sel], ent[row][sel]))
    if layout != "padded":
        assert mixed_rows > 0  # samples of different temperatures share a packed row
    assert sorted(got) == list(range(batch.num_samples))
    for i, s in enumerate(batch.sample_slices()):
        tokens = torch.from_numpy(batch.tokens[s])[None]
        t = temps[i % len(temps)]
        with torch.no_grad():
            logits = model(input_ids=tokens).logits
        want_lp, want_ent = (x[0] for x in token_logprobs_and_entropy(logits, tokens, t))
        lp, ent = (torch.cat(x) for x in zip(*got[i]))
        # Layout changes only the shapes of the matrix products and attention's sums: float32
        # rounding of the logits, at most sample_gap, divided by the temperature: e per scaled
        # logit. A logprob moves by at most 2e; the entropy H = lse(x) - sum p x, whose gradient
        # is -p_j (x_j - mean_p x), by at most e * sum_j p_j |x_j - mean| on the way, where p
        # moves by a factor e^(2e) and x by e: below e^(2e) e (sum p |x - mean| + 2e).
        e = sample_gap(model, batch, i) / t
        assert ((lp - want_lp).abs() <= 2 * e).all(), ((lp - want_lp).abs() - 2 * e).max()
        x = logits[0, :-1].double() / t
        p = x.softmax(-1)
        spread = (p * (x - (p * x).sum(-1, keepdim=True)).abs()).sum(-1)
        ent_bound = torch.exp(2 * e) * e * (spread + 2 * e)
        assert ((ent - want_ent).abs() <= ent_bound).all(), ((ent - want_ent).abs() - ent_bound).max()
        if t != 1.0:  # the batch-wide temperature 1.0 would be far off: beyond what rounding allows
            at_one = token_logprobs_and_entropy(logits, tokens, 1.0)[0][0]
            assert ((lp - at_one).abs() > 2 * e).any()


def sampled_batch() -> Batch:
    return Batch.from_samples(3, [
        single_turn([5, 6], [7, 8], [-1.0, -2.0], [2, 2], 1.0, 0.5,
                           temperature=0.7, top_p=0.9, top_k=20, min_p=0.05),
        single_turn([5], [9], [-0.5], [1], 0.0, -0.5),  # the defaults
        Sample([4, 5, 6], [0, 1, 1], [0.0, -0.1, -0.2], [0.0, 1.0, 1.0], [-1, 2, 2], 1.0, temperature=1.5),
    ])


def test_batch_round_trip_keeps_per_sample_sampling_settings(tmp_path):
    batch = sampled_batch()
    meta, payload = batch.encode()
    assert set(json.loads(meta)) == {"format", "step", "num_samples", "sha256"}  # no batch-wide temperature
    Batch.write_encoded(meta, payload, tmp_path / "step_3")
    for back in (Batch.decode(meta, payload, "wire"), Batch.read(tmp_path / "step_3")):
        assert back.temperatures.dtype == back.top_p.dtype == back.min_p.dtype == np.float32
        assert back.top_k.dtype == np.int64
        assert back.temperatures.tolist() == pytest.approx([0.7, 1.0, 1.5])
        assert back.top_p.tolist() == pytest.approx([0.9, 1.0, 1.0])
        assert back.top_k.tolist() == [20, -1, -1]
        assert back.min_p.tolist() == pytest.approx([0.05, 0.0, 0.0])
        for name in Batch._TENSORS:
            np.testing.assert_array_equal(getattr(back, name), getattr(batch, name))


@pytest.mark.parametrize("name, value, want", [
    ("temperatures", 0.0, "finite and > 0"), ("temperatures", -0.5, "finite and > 0"),
    ("temperatures", math.nan, "finite and > 0"), ("temperatures", math.inf, "finite and > 0"),
    ("top_p", 0.0, "in (0, 1]"), ("top_p", 1.5, "in (0, 1]"), ("top_p", math.nan, "in (0, 1]"),
    ("min_p", -0.1, "in [0, 1]"), ("min_p", 1.1, "in [0, 1]"), ("top_k", -2, "-1 (off)"),
])
def test_decode_rejects_out_of_range_sampling_settings_naming_them(name, value, want):
    batch = sampled_batch()
    getattr(batch, name)[1] = value
    meta, payload = batch.encode()  # checksummed as written: only the range check can catch it
    with pytest.raises(BatchError) as e:
        Batch.decode(meta, payload, "rollouts/step_3/batch.safetensors")
    msg = str(e.value)
    assert msg.startswith(f"rollouts/step_3/batch.safetensors: tensor {name!r} holds "), msg
    assert "for sample 1" in msg and want in msg, msg


def test_from_samples_refuses_a_non_positive_temperature():
    with pytest.raises(ValueError, match=r"tensor 'temperatures' holds 0.0 for sample 0"):
        Batch.from_samples(1, [single_turn([5], [7], [-1.0], [0], 1.0, 0.5, temperature=0.0)])
