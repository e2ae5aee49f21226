"""String copying: the same prompts as string reversal ("abc="), but the answer is the string
itself. A second task on the same base model, for multi-run LoRA (configs/lora_multi/).

Config use:
    [orchestrator]
    dataset = "tasks.echo:dataset"
    reward = "tasks.echo:reward"
"""

from __future__ import annotations

import difflib
import random
from collections.abc import Iterator

from tasks.reverse import make_row


def dataset(seed: int) -> Iterator[dict]:
    """An endless, seeded stream of rows {prompt, answer}: answer = the prompt without '='."""
    rng = random.Random(seed)
    while True:
        row = make_row(rng)
        yield {"prompt": row["prompt"], "answer": row["prompt"][:-1]}


def reward(prompt: str, completion: str, row: dict) -> float:
    """Similarity of the completion to the prompt's string (difflib ratio), in [0, 1]."""
    return difflib.SequenceMatcher(None, completion.strip(), row["answer"]).ratio()
