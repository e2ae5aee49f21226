"""Guess the letter: a multi-turn environment. The model guesses a secret letter; after each
wrong guess the environment answers "up=" (the secret comes later in the alphabet) or "down="
and the model guesses again, up to orchestrator.environment.max_turns times. Binary search finds any letter in
five guesses, so the reward pays for finding it early.

    [orchestrator.environment]
    class = "tasks.guess_letter:GuessLetter"
    max_turns = 6

Everything is lowercase letters and "=", the tiny char-level model's whole vocabulary.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from orchestrator.rollout.environment import Turn
from tasks.reverse import ALPHABET

START = "guess="


class GuessLetter:
    def dataset(self, seed: int) -> Iterator[dict]:
        rng = random.Random(seed)
        while True:
            yield {"secret": rng.choice(ALPHABET)}

    def episode(self, row: dict) -> Game:
        return Game(row["secret"])


class Game:
    def __init__(self, secret: str):
        self.secret, self.guesses = secret, 0

    def start(self) -> str:
        return START

    def step(self, completion: str) -> Turn:
        self.guesses += 1
        guess = next((c for c in completion if c in ALPHABET), None)
        if guess == self.secret:
            return Turn(reward=1.0 - 0.1 * (self.guesses - 1), done=True)
        if guess is None:
            return Turn(observation=START)  # no letter: ask again
        return Turn(observation="up=" if self.secret > guess else "down=")
