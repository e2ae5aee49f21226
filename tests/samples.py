"""Samples and batches as the tests build them: a prompt, then a completion the model sampled; a
batch written where the trainer reads it."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from rl.batch import Batch, Sample


def single_turn(prompt_ids: list[int], completion_ids: list[int], logprobs: list[float], versions: list[int],
                reward: float, advantage: float, *, temperature: float = 1.0, top_p: float = 1.0,
                top_k: int = -1, min_p: float = 0.0, kept: list[list[int]] | None = None) -> Sample:
    """The prompt's tokens as context (loss mask 0, no version), the completion's trained on
    with one advantage for all; `kept`: the sampler's kept set of each completion token."""
    if not len(completion_ids) == len(logprobs) == len(versions):
        raise ValueError(f"{len(completion_ids)} tokens, {len(logprobs)} logprobs, {len(versions)} versions")
    p, c = len(prompt_ids), len(completion_ids)
    counts, ids = ([0] * p + [len(k) for k in kept], [t for k in kept for t in k]) if kept else ([], [])
    return Sample(list(prompt_ids) + list(completion_ids), [0] * p + [1] * c, [0.0] * p + list(logprobs),
                  [0.0] * p + [advantage] * c, [-1] * p + list(versions), reward, temperature, top_p, top_k, min_p,
                  kept_counts=counts, kept_ids=ids)


def write_batch(batch: Batch, directory: Path) -> None:
    """As the orchestrator's file transport writes it (atomically)."""
    Batch.write_encoded(*batch.encode(), directory)


def variable_batch(seed: int = 0, n: int = 12, temperatures: list[float] = (1.0,)) -> Batch:
    """Samples of random lengths; sample i is sampled at temperatures[i % len(temperatures)]."""
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(n):
        prompt = rng.integers(2, 30, size=int(rng.integers(3, 9))).tolist()
        completion = rng.integers(2, 30, size=int(rng.integers(1, 40))).tolist()
        logprobs = (-rng.random(len(completion))).tolist()
        samples.append(single_turn(prompt, completion, logprobs, [0] * len(completion),
                                   reward=float(rng.random()), advantage=float(rng.normal()),
                                   temperature=temperatures[i % len(temperatures)]))
    return Batch.from_samples(1, samples)
