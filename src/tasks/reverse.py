"""String reversal: the prompt is a short lowercase string followed by '=', the answer its reverse.

Config use:
    [orchestrator]
    dataset = "tasks.reverse:dataset"
    reward = "tasks.reverse:reward"

The reward is a similarity in [0, 1] rather than exact match so that partly right completions give
the group-relative advantage something to rank; a tiny model rarely gets a whole string right.
"""

from __future__ import annotations

import difflib
import random
from collections.abc import Iterator

ALPHABET = "abcdefghijklmnopqrstuvwxyz"
SEPARATOR = "="
MIN_LEN, MAX_LEN = 3, 8
MAX_ANSWER = MAX_LEN
HELDOUT_SEED, HELDOUT_ROWS = 10_000, 100


def make_row(rng: random.Random) -> dict:
    text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(MIN_LEN, MAX_LEN)))
    return {"prompt": text + SEPARATOR, "answer": text[::-1]}


def dataset(seed: int) -> Iterator[dict]:
    """An endless, seeded stream of rows {prompt, answer}."""
    rng = random.Random(seed)
    while True:
        yield make_row(rng)


def heldout(seed: int) -> Iterator[dict]:
    """The held-out rows the model's SFT is measured on (configs/sft_tiny_reverse.toml): row i from
    Random(HELDOUT_SEED + i), whatever the seed (the rows its builder has always measured it on)."""
    for i in range(HELDOUT_ROWS):
        yield make_row(random.Random(HELDOUT_SEED + i))


def reward(prompt: str, completion: str, row: dict) -> float:
    """Similarity of the completion to the reversed prompt (difflib ratio), in [0, 1]."""
    return difflib.SequenceMatcher(None, completion.strip(), row["answer"]).ratio()
