"""Small coding tasks with tests, generated (seeded), and their reward: the model's code run
against the tests in the sandbox (orchestrator/sandbox.py), scored by the share that pass.

    [[orchestrator.datasets]]
    function = "orchestrator.tasks.coding:dataset"
    reward = "orchestrator.tasks.coding:reward"

A row: {"prompt": "Write a Python function ...", "entry_point": "name", "tests": ["assert ...", ...],
"solution": "def ...: ..."} (the solution for checking the tests, never shown to the model). The
model's answer is the last ```python fenced block of its completion, else all of it. Each test
runs on its own after the code, so one failing assertion costs only its share; a run that fails
before any test (syntax error, a hang, a fork bomb) scores 0.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator

from orchestrator.sandbox import Limits, Sandbox

SANDBOX = Sandbox(Limits(wall_s=10, cpu_s=5, memory_mb=512, output_bytes=4096))
FENCE = re.compile(r"```(?:python|py)?\n(.*?)```", re.DOTALL)


def _arith(rng: random.Random) -> dict:
    k = rng.randint(2, 9)
    op, word = rng.choice([("+", "plus"), ("*", "times"), ("-", "minus")])
    name = f"{word}_{k}"
    cases = [rng.randint(-50, 50) for _ in range(4)]
    return {"prompt": f"Write a Python function `{name}(x)` that returns x {word} {k}.", "entry_point": name,
            "tests": [f"assert {name}({x}) == {eval(f'{x} {op} {k}')}" for x in cases],
            "solution": f"def {name}(x):\n    return x {op} {k}\n"}


def _strings(rng: random.Random) -> dict:
    kind = rng.choice(["reverse", "upper", "count"])
    words = ["".join(rng.choice("abcdeiou") for _ in range(rng.randint(2, 7))) for _ in range(4)]
    if kind == "reverse":
        return {"prompt": "Write a Python function `backwards(s)` that returns the string s reversed.",
                "entry_point": "backwards", "tests": [f"assert backwards({w!r}) == {w[::-1]!r}" for w in words],
                "solution": "def backwards(s):\n    return s[::-1]\n"}
    if kind == "upper":
        return {"prompt": "Write a Python function `shout(s)` that returns s in upper case.", "entry_point": "shout",
                "tests": [f"assert shout({w!r}) == {w.upper()!r}" for w in words],
                "solution": "def shout(s):\n    return s.upper()\n"}
    letter = rng.choice("aeiou")
    name = f"count_{letter}"
    return {"prompt": f"Write a Python function `{name}(s)` that returns how many times {letter!r} occurs in s.",
            "entry_point": name, "tests": [f"assert {name}({w!r}) == {w.count(letter)}" for w in words],
            "solution": f"def {name}(s):\n    return s.count({letter!r})\n"}


def _lists(rng: random.Random) -> dict:
    kind = rng.choice(["largest", "total", "evens"])
    lists = [[rng.randint(-20, 20) for _ in range(rng.randint(1, 6))] for _ in range(4)]
    body = {"largest": "max(xs)", "total": "sum(xs)", "evens": "[x for x in xs if x % 2 == 0]"}[kind]
    about = {"largest": "the largest number in the list xs", "total": "the sum of the list xs",
             "evens": "the even numbers of the list xs, in order"}[kind]
    return {"prompt": f"Write a Python function `{kind}(xs)` that returns {about}.", "entry_point": kind,
            "tests": [f"assert {kind}({xs}) == {eval(body, {'xs': xs})}" for xs in lists],
            "solution": f"def {kind}(xs):\n    return {body}\n"}


def make_row(rng: random.Random) -> dict:
    return rng.choice([_arith, _strings, _lists])(rng)


def dataset(seed: int) -> Iterator[dict]:
    """An endless, seeded stream of coding rows."""
    rng = random.Random(seed)
    while True:
        yield make_row(rng)


def program(code: str, tests: list[str]) -> str:
    """The model's code, then each test on its own; prints PASSED k/n as its last line."""
    return (f"{code}\n\n_passed = 0\n_tests = {json.dumps(tests)}\n"
            "for _test in _tests:\n"
            "    try:\n        exec(_test)\n        _passed += 1\n"
            "    except Exception:\n        pass\n"
            "print(f'PASSED {_passed}/{len(_tests)}')\n")


def answer_code(completion: str) -> str:
    blocks = FENCE.findall(completion)
    return blocks[-1] if blocks else completion


async def reward(prompt: str, completion: str, row: dict) -> float:
    result = await SANDBOX.run(program(answer_code(completion), row["tests"]))
    found = re.findall(r"^PASSED (\d+)/(\d+)$", result.stdout, re.MULTILINE)
    if result.outcome != "ok" or not found:
        return 0.0
    passed, total = map(int, found[-1])
    return passed / total
