"""Images in the batch (rl/batch.py) and in the trainer's micro-batches (trainer/data.py): each
sample's PNG bytes survive the wire format exactly, a text batch carries none, a batch written
before images decodes as one without, and a packed micro-batch lists its rows' images in the
order of their placeholders."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from rl.batch import FORMAT, Batch, BatchError
from samples import single_turn
from trainer.data import loss_weights, rank_micro_batches

IMAGE = 4  # models/tiny-vlm's image token id


def samples():
    out = []
    for k, images in enumerate([[b"png-a", b"png-bb"], [], [b"png-ccc"]]):
        prompt = [1] + [IMAGE] * (2 * len(images)) + [7]
        s = single_turn(prompt, [8, IMAGE, 9][: 2 + k % 2], [-1.0] * (2 + k % 2), [0] * (2 + k % 2),
                        reward=1.0, advantage=0.5)
        s.images = images
        out.append(s)
    return out


def test_images_cross_the_wire_exactly():
    batch = Batch.from_samples(1, samples())
    back = Batch.decode(*batch.encode(), "test")
    assert [back.sample_images(i) for i in range(3)] == [[b"png-a", b"png-bb"], [], [b"png-ccc"]]
    assert back.image_counts.tolist() == [2, 0, 1] and back.image_sizes.tolist() == [5, 6, 7]


def test_a_text_batch_carries_no_images_and_an_older_batch_decodes():
    text = samples()
    for s in text:
        s.images = []
    batch = Batch.from_samples(1, text)
    assert not batch.has_images and len(batch.image_bytes) == 0
    meta, payload = batch.encode()
    arrays = {k: v for k, v in st_load(payload).items() if not k.startswith("image_")}
    old = st_save(arrays, metadata={"format": FORMAT})
    import hashlib
    import json

    meta = json.dumps({**json.loads(meta), "sha256": hashlib.sha256(old).hexdigest()}).encode()
    decoded = Batch.decode(meta, old, "old")
    assert not decoded.has_images and decoded.sample_images(0) == []


def test_inconsistent_image_tensors_are_refused_by_name():
    batch = Batch.from_samples(1, samples())
    batch.image_sizes = np.asarray([5, 6, 8], np.int64)  # one byte more than carried
    with pytest.raises(BatchError, match="image_bytes"):
        batch.validate("test")


@pytest.mark.parametrize("pack", [True, False])
def test_micro_batches_list_their_rows_images_in_placeholder_order(pack):
    batch = Batch.from_samples(1, samples())
    weights = loss_weights(batch, "token", 0)
    mbs = rank_micro_batches(batch, 0, 1, row_len=64 if pack else None, per_micro_batch=4 if pack else 1,
                             pad_id=0, weights=weights)
    for mb in mbs:
        ids = mb.tokens.reshape(-1)
        placeholders = int(((ids == IMAGE) & ~mb.sampled.reshape(-1)).sum())
        assert placeholders == 2 * len(mb.images)  # each made-up image: 2 placeholders
    listed = [im for mb in mbs for im in mb.images]
    assert sorted(listed) == [b"png-a", b"png-bb", b"png-ccc"]
    if pack:  # one row: samples in the row's order, each sample's images in its own order
        (mb,) = mbs
        assert listed.index(b"png-a") + 1 == listed.index(b"png-bb")
    # Each sample's completion holds a sampled <image>: marked sampled, not a placeholder.
    assert sum(int(((mb.tokens == IMAGE) & mb.sampled).sum()) for mb in mbs) == 3
