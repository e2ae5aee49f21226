"""The shapes task (tasks/shapes.py) with pictures in the environment kinds' turns (docs/vlm.md,
"Pictures in tool results and environment turns"):

- `ShapesTools` (the built-in tool loop): the question names a board; the tool `look(board)`
  returns its picture (a PIL image) and a caption; the reward is 1 when the model's final answer
  is the board's count.
- `ShapesTurns` (a text environment): the episode starts with a board and the question, the
  model answers, the observation is a second board ("And in this picture?"), and the reward is
  the second answer against the second board's count.

A board is drawn from its name (`board_of`): any name is a board, the same name the same picture,
so a tool needs no episode state. Rows are seeded: row i of seed s names board "s-i" (and
"s-i-b" for the text environment's second).

    model = "models/tiny-vlm"
    [orchestrator.environment]
    class = "tasks.shapes_tools:ShapesTools"      # or tasks.shapes_tools:ShapesTurns
"""

from __future__ import annotations

import io
import random
from collections.abc import Iterator

from orchestrator.rollout.environment import Turn
from tasks.shapes import QUESTION, draw, reward
from tasks.shapes_agent import AGAIN

ASK = "Call look with board {board} to see the picture. How many shapes are in it? Answer with a number."


def board_of(name: str) -> tuple[bytes, int]:
    """(PNG bytes, number of shapes) of the board called `name`."""
    return draw(random.Random(f"board/{name}"))


def image(png: bytes):
    from PIL import Image

    return Image.open(io.BytesIO(png))


def look(board: str):
    """Show a board of shapes.

    Args:
        board: the board's name, as the question gives it.
    """
    return [image(board_of(board)[0]), f"Board {board}."]


class ShapesTools:
    tools = [look]

    def dataset(self, seed: int) -> Iterator[dict]:
        """Endless seeded rows {"prompt", "board", "answer"}."""
        i = 0
        while True:
            name = f"{seed}-{i}"
            yield {"prompt": ASK.format(board=name), "board": name, "answer": str(board_of(name)[1])}
            i += 1

    def reward(self, messages: list[dict], row: dict) -> float:
        last = messages[-1]["content"] if messages[-1]["role"] == "assistant" else ""
        return reward("", last, row)


class ShapesTurns:
    def dataset(self, seed: int) -> Iterator[dict]:
        """Endless seeded rows {"boards": two names, "answers": their counts}."""
        i = 0
        while True:
            names = [f"{seed}-{i}", f"{seed}-{i}-b"]
            yield {"boards": names, "answers": [str(board_of(n)[1]) for n in names]}
            i += 1

    def episode(self, row: dict) -> BoardsEpisode:
        return BoardsEpisode(row)


class BoardsEpisode:
    def __init__(self, row: dict):
        self.row, self.turn = row, 0

    def start(self) -> list:
        return [image(board_of(self.row["boards"][0])[0]), QUESTION]

    def step(self, completion: str):
        self.turn += 1
        if self.turn == 1:
            return Turn(observation=["\n", image(board_of(self.row["boards"][1])[0]), AGAIN])
        return Turn(reward=reward("", completion, {"answer": self.row["answers"][1]}), done=True)
