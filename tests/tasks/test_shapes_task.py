"""tasks/shapes.py, the VLM demo's visual task: the answer is what the picture shows (one colour
per shape, counted from the pixels), rows are seeded, the held-out split shares no picture with
training rows, and a row renders through the orchestrator's image path for models/tiny-vlm."""

from __future__ import annotations

import base64
import io
import itertools

from PIL import Image

from conftest import ROOT
from orchestrator.rendering.chat import ChatTemplate
from orchestrator.rendering.images import image_support, render_image_prompt
from orchestrator.rendering.tokenizer import load_tokenizer
from tasks import shapes


def picture(row: dict) -> bytes:
    url = row["messages"][0]["content"][0]["image_url"]["url"]
    return base64.b64decode(url.split(",", 1)[1])


def test_the_answer_is_the_number_of_colours_drawn():
    for row in itertools.islice(shapes.dataset(0), 200):
        image = Image.open(io.BytesIO(picture(row))).convert("RGB")
        colours = {c for _, c in image.getcolors(maxcolors=SIZE_SQUARED)} - {(255, 255, 255)}
        assert len(colours) == int(row["answer"]) and set(colours) <= set(shapes.PALETTE)
    counts = {row["answer"] for row in itertools.islice(shapes.dataset(0), 200)}
    assert counts == {"1", "2", "3", "4"}


SIZE_SQUARED = shapes.SIZE * shapes.SIZE


def test_seeded_and_held_out_apart():
    first = [picture(r) for r in itertools.islice(shapes.dataset(3), 50)]
    assert first == [picture(r) for r in itertools.islice(shapes.dataset(3), 50)]
    assert first != [picture(r) for r in itertools.islice(shapes.dataset(4), 50)]
    held = [picture(r) for r in shapes.heldout(0)]
    assert len(held) == shapes.HELDOUT_ROWS and held == [picture(r) for r in shapes.heldout(7)]
    train = {picture(r) for seed in range(3) for r in itertools.islice(shapes.dataset(seed), 1000)}
    assert not train & set(held)


def test_reward_and_rendering():
    row = next(shapes.dataset(0))
    assert shapes.reward("", f" {row['answer']} shapes", row) == 1.0
    assert shapes.reward("", "no idea", row) == 0.0 and shapes.reward("", "12", {"answer": "1"}) == 0.0
    model = ROOT / "models" / "tiny-vlm"
    prompt = render_image_prompt(ChatTemplate.load(model), image_support(model), load_tokenizer(str(model)),
                                 row["messages"], [])
    assert len(prompt.images) == 1 and len(prompt.token_ids) < 64
