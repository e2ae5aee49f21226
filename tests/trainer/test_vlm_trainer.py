"""The trainer's VLM forward (trainer/vision.py) on models/tiny-vlm: samples with images packed
into one row (positions restarting per sample, packed attention) give each sample the logprobs
it gets alone, within float32 rounding's bound (tests/float32_rounding.py: the language model is
the tiny models' shape, 4 layers, widest product 384; each image's features are computed the
same way packed or not). Features put in the wrong order move them far past the bound. And the
batch's PNG bytes against the processed pixels they stand for: which is smaller."""

from __future__ import annotations

import pytest
import torch

from conftest import ROOT
from float32_rounding import LOGIT_ERROR
from orchestrator.rendering.chat import ChatTemplate
from orchestrator.rendering.images import image_support, render_image_prompt
from orchestrator.rendering.tokenizer import load_tokenizer
from vlm_pictures import data_url, part, picture
from trainer import packed_attention
from trainer.vision import bidirectional, vision_for

MODEL = ROOT / "models" / "tiny-vlm"


@pytest.fixture(scope="module")
def vision():
    from transformers import Idefics3ForConditionalGeneration

    packed_attention.register()
    model = Idefics3ForConditionalGeneration.from_pretrained(MODEL, attn_implementation=packed_attention.NAME)
    bidirectional(model)  # as the trainer loads it (trainer/model.py)
    return vision_for(model.eval(), MODEL)


def samples():
    """(ids, images) of three samples: two pictures, none, one; a completion after each prompt."""
    template, support, tokenizer = ChatTemplate.load(MODEL), image_support(MODEL), load_tokenizer(str(MODEL))
    chats = [
        [part(data_url(picture(100, 60))), {"type": "text", "text": "How many shapes?"},
         part(data_url(picture(50, 80, (10, 10, 220))))],
        "Which colour is the dot?",
        [{"type": "text", "text": "What digit is drawn?"}, part(data_url(picture(64, 64, (20, 160, 40))))],
    ]
    out = []
    for k, content in enumerate(chats):
        p = render_image_prompt(template, support, tokenizer, [{"role": "user", "content": content}], [])
        completion = tokenizer.encode(["red", "2", "seven"][k], add_special_tokens=False).ids
        out.append((p.token_ids + completion, p.images))
    return out


def head_bounds(model):
    """Per forward, each position's rounding bound of a logit: LOGIT_ERROR * max_v sum_j |E_vj h_j|."""
    seen = []
    head = model.get_output_embeddings()
    hook = head.register_forward_hook(
        lambda m, i, o: seen.append(LOGIT_ERROR * (i[0][0].abs() @ head.weight.abs().T).max(-1).values))
    return seen, hook


def logprobs(logits: torch.Tensor, ids: list[int]) -> torch.Tensor:
    return logits[:-1].log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_packed_logprobs_equal_unpacked_within_rounding(vision):
    model = vision.model
    seen, hook = head_bounds(model)
    try:
        with torch.no_grad():
            alone = []
            for ids, images in samples():
                t = torch.tensor([ids])
                logits = vision.logits(t, torch.arange(len(ids))[None], images)[0]
                alone.append((logprobs(logits, ids), seen[-1][:-1]))
            parts = samples()
            ids = [t for s, _ in parts for t in s]
            positions = torch.cat([torch.arange(len(s)) for s, _ in parts])[None]
            images = [im for _, ims in parts for im in ims]
            packed_logits = vision.logits(torch.tensor([ids]), positions, images)[0]
            packed_bound = seen[-1]
            swapped = vision.logits(torch.tensor([ids]), positions, [images[1], images[0], images[2]])[0]
    finally:
        hook.remove()
    start = 0
    for k, (s, _) in enumerate(parts):
        end = start + len(s)
        got = logprobs(packed_logits[start:end], s)
        want, bound_alone = alone[k]
        bound = 2 * (bound_alone + packed_bound[start:end - 1])
        assert ((got - want).abs() <= bound).all(), ((got - want).abs() - bound).max()
        if k == 0:  # its two pictures swapped: the sample reads them
            moved = (logprobs(swapped[start:end], s) - want).abs()
            assert (moved > bound).any()
        start = end


def test_png_bytes_are_smaller_than_the_processed_pixels(vision):
    for _, images in samples():
        for png in images:
            pixels = vision.pixels(png)
            processed = sum(v.numel() * v.element_size() for v in pixels.values())
            assert len(png) * 10 < processed, (len(png), processed)
