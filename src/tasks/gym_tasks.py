"""Scoring for reasoning-gym tasks (`[[orchestrator.datasets]] reasoning_gym = "<task>"`): each
task's own scorer, found by the task name its rows carry (orchestrator/prompts/tables.py makes the rows).

The answer scored is what the completion puts between <answer> and </answer> if it has those
tags (reasoning-gym's suggested format, for models that think first), else the whole completion,
stripped. Scores are in [0, 1]; some tasks give partial credit (spell_backward: the share of
letters right), which gives a group's ranking something to work with early on.
"""

from __future__ import annotations

import functools
import re

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


@functools.cache
def _scorer(task: str):
    from reasoning_gym import get_score_answer_fn

    return get_score_answer_fn(task)


def extract_answer(completion: str) -> str:
    tagged = ANSWER.findall(completion)
    return (tagged[-1] if tagged else completion).strip()


def reward(prompt: str, completion: str, row: dict) -> dict[str, float]:
    """Components: `score`, the task's own score; `correct`, 1 when that score is full marks.
    By default the reward is the score (correct weighs 0, see reward.weights); a dataset's
    reward_weights may trade partial credit for exactness, e.g. {score = 0.5, correct = 1.0}."""
    task = row["metadata"]["source_dataset"]
    entry = {"question": prompt, "answer": row["answer"], "metadata": row["metadata"]}
    score = float(_scorer(task)(extract_answer(completion), entry))
    return {"score": score, "correct": float(score >= 1.0)}


reward.weights = {"correct": 0.0}
