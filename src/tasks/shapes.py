"""Counting shapes in a picture: the visual task of the VLM demo (issue 62, docs/vlm.md). Each row
is a 64x64 white picture (models/tiny-vlm's image size) with 1-4 filled circles or squares, each
in its own colour, placed without overlap, and the question "How many shapes are in the
picture? Answer with a number."; the answer is the count as a digit.

Rows are OpenAI chat messages with the picture as a data: URL image part
(orchestrator/rendering/images.py), so they need no files. Seeded and split: training row i of
seed s is drawn from Random("train/s/i"), held-out row i from Random("heldout/i") whatever the
seed, so the two never share a draw (tests/tasks/test_shapes_task.py checks no picture repeats).

Config use (rl run carries the images: docs/vlm.md):
    [orchestrator]
    dataset = "tasks.shapes:dataset"
    reward = "tasks.shapes:reward"
"""

from __future__ import annotations

import base64
import io
import random
import re
from collections.abc import Iterator

SIZE = 64
MAX_SHAPES = 4
QUESTION = "How many shapes are in the picture? Answer with a number."
PALETTE = [(220, 30, 30), (30, 160, 40), (20, 40, 220), (230, 200, 20), (150, 40, 170), (20, 170, 190)]
HELDOUT_ROWS = 200


def draw(rng: random.Random) -> tuple[bytes, int]:
    """(PNG bytes, number of shapes)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
    pen = ImageDraw.Draw(image)
    count = rng.randint(1, MAX_SHAPES)
    colours = rng.sample(PALETTE, count)
    boxes: list[tuple[int, int, int, int]] = []
    while len(boxes) < count:  # rejection sampling: 4 shapes of <= 20 px fit easily in 64x64
        side = rng.randint(10, 20)
        x, y = rng.randint(0, SIZE - side - 1), rng.randint(0, SIZE - side - 1)
        box = (x, y, x + side, y + side)
        if all(box[2] + 2 < b[0] or b[2] + 2 < box[0] or box[3] + 2 < b[1] or b[3] + 2 < box[1] for b in boxes):
            boxes.append(box)
    for box, colour in zip(boxes, colours):
        (pen.ellipse if rng.random() < 0.5 else pen.rectangle)(box, fill=colour)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue(), count


def make_row(rng: random.Random) -> dict:
    png, count = draw(rng)
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]
    return {"messages": [{"role": "user", "content": content}], "answer": str(count)}


def dataset(seed: int) -> Iterator[dict]:
    """An endless, seeded stream of training rows {messages, answer}."""
    i = 0
    while True:
        yield make_row(random.Random(f"train/{seed}/{i}"))
        i += 1


def sft_rows(seed: int) -> Iterator[dict]:
    """`rl sft`'s rows: the training stream of another seed (seed + 1,000,000: not the RL run's
    rows) with the answer as the assistant's turn."""
    for row in dataset(seed + 1_000_000):
        yield {"messages": [*row["messages"], {"role": "assistant", "content": row["answer"]}]}


def sft_heldout(seed: int) -> Iterator[dict]:
    """The held-out rows with their answers as the assistant's turn: `rl sft`'s held-out loss."""
    for row in heldout(seed):
        yield {"messages": [*row["messages"], {"role": "assistant", "content": row["answer"]}]}


def heldout(seed: int) -> Iterator[dict]:
    """The HELDOUT_ROWS held-out rows, the same whatever the seed."""
    for i in range(HELDOUT_ROWS):
        yield make_row(random.Random(f"heldout/{i}"))


def reward(prompt: str, completion: str, row: dict) -> float:
    """1 when the completion's first number is the count, else 0."""
    found = re.search(r"\d+", completion)
    return float(found is not None and found.group() == row["answer"])
