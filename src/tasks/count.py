"""Counting on: the prompt is a lowercase word of 8-16 letters followed by '=', the answer the
alphabet continued from the word's last letter (wrapping after z) for 16 characters per letter of
the word (128-256 characters): "abcdefgh=" -> "ijkl...", 128 long.

The generation-heavy workload of the performance benchmarks (docs/performance.md): completions are
long and their length varies with the prompt, as reasoning traces do, so a step's time goes into
decoding. Same alphabet as the reversal task, so both models share one character tokenizer.

Config use:
    [orchestrator]
    dataset = "tasks.count:dataset"
    reward = "tasks.count:reward"
"""

from __future__ import annotations

import difflib
import random
from collections.abc import Iterator

from tasks.reverse import ALPHABET, HELDOUT_SEED, SEPARATOR

MIN_LEN, MAX_LEN = 8, 16
TIMES = 16
MAX_ANSWER = MAX_LEN * TIMES
HELDOUT_ROWS = 4   # 256-character answers: 4 greedy ones tell the skill


def make_row(rng: random.Random) -> dict:
    word = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(MIN_LEN, MAX_LEN)))
    start = ALPHABET.index(word[-1]) + 1
    answer = "".join(ALPHABET[(start + i) % len(ALPHABET)] for i in range(TIMES * len(word)))
    return {"prompt": word + SEPARATOR, "answer": answer}


def dataset(seed: int) -> Iterator[dict]:
    """An endless, seeded stream of rows {prompt, answer}."""
    rng = random.Random(seed)
    while True:
        yield make_row(rng)


def heldout(seed: int) -> Iterator[dict]:
    """The held-out rows the model's SFT is measured on (configs/sft_long_count.toml): row i from
    Random(HELDOUT_SEED + i), whatever the seed (the rows its builder has always measured it on)."""
    for i in range(HELDOUT_ROWS):
        yield make_row(random.Random(HELDOUT_SEED + i))


def reward(prompt: str, completion: str, row: dict) -> float:
    """Similarity of the completion to the answer (difflib ratio), in [0, 1]: a wrong length costs
    in proportion to the characters missing or extra."""
    return difflib.SequenceMatcher(None, completion.strip(), row["answer"], autojunk=False).ratio()
