"""Small coding tasks with tests, generated (seeded), and their reward: the model's code run in
the sandbox (orchestrator/sandbox/sandbox.py) on each test's arguments, its return values compared here,
outside, with the expected ones; scored by the share that match.

    [[orchestrator.datasets]]
    function = "tasks.coding:dataset"
    reward = "tasks.coding:reward"

A row: {"prompt": "Write a Python function ...", "entry_point": "name", "cases": [{"args": [...],
"expected": ...}, ...], "solution": "def ...: ..."} (the solution for checking the cases, never
shown to the model). Rows of the older format, "tests": ["assert name(args) == expected", ...],
are read too. The model's answer is the last ```python fenced block of its completion, else all
of it.

Why the verdict cannot be forged: the model's code runs in the same interpreter as the harness
that calls it, so it can pre-empt anything the harness does (print a verdict, register atexit,
patch json or builtins, exit early). So the sandbox decides nothing: the expected values never
enter it (only the arguments do), the harness writes back each call's return value as JSON, and
the comparison happens here, on values parsed by a fresh `json`, with exact types (an object whose
__eq__ is always True, or an int subclass, is no int: it is not serialised). Whatever the code
writes on the channel, it can only score by returning the right values, that is, by solving the
task. A run whose channel holds anything but exactly one document of one result per case
(nothing, two documents, garbage) scores 0, as does a run that did not exit cleanly. A call that
raises costs only its case.
"""

from __future__ import annotations

import ast
import json
import random
import re
from collections.abc import Iterator

from orchestrator.sandbox.sandbox import Limits, RunResult, Sandbox

SANDBOX = Sandbox(Limits(wall_s=10, cpu_s=5, memory_mb=512, output_bytes=4096))
FENCE = re.compile(r"```(?:python|py)?\n(.*?)```", re.DOTALL)


def _row(prompt: str, name: str, calls: list[tuple[list, object]], solution: str) -> dict:
    return {"prompt": prompt, "entry_point": name, "cases": [{"args": a, "expected": e} for a, e in calls],
            "solution": solution}


def _arith(rng: random.Random) -> dict:
    k = rng.randint(2, 9)
    op, word = rng.choice([("+", "plus"), ("*", "times"), ("-", "minus")])
    name = f"{word}_{k}"
    cases = [rng.randint(-50, 50) for _ in range(4)]
    return _row(f"Write a Python function `{name}(x)` that returns x {word} {k}.", name,
                [([x], eval(f"{x} {op} {k}")) for x in cases], f"def {name}(x):\n    return x {op} {k}\n")


def _strings(rng: random.Random) -> dict:
    kind = rng.choice(["reverse", "upper", "count"])
    words = ["".join(rng.choice("abcdeiou") for _ in range(rng.randint(2, 7))) for _ in range(4)]
    if kind == "reverse":
        return _row("Write a Python function `backwards(s)` that returns the string s reversed.", "backwards",
                    [([w], w[::-1]) for w in words], "def backwards(s):\n    return s[::-1]\n")
    if kind == "upper":
        return _row("Write a Python function `shout(s)` that returns s in upper case.", "shout",
                    [([w], w.upper()) for w in words], "def shout(s):\n    return s.upper()\n")
    letter = rng.choice("aeiou")
    name = f"count_{letter}"
    return _row(f"Write a Python function `{name}(s)` that returns how many times {letter!r} occurs in s.", name,
                [([w], w.count(letter)) for w in words], f"def {name}(s):\n    return s.count({letter!r})\n")


def _lists(rng: random.Random) -> dict:
    kind = rng.choice(["largest", "total", "evens"])
    lists = [[rng.randint(-20, 20) for _ in range(rng.randint(1, 6))] for _ in range(4)]
    body = {"largest": "max(xs)", "total": "sum(xs)", "evens": "[x for x in xs if x % 2 == 0]"}[kind]
    about = {"largest": "the largest number in the list xs", "total": "the sum of the list xs",
             "evens": "the even numbers of the list xs, in order"}[kind]
    return _row(f"Write a Python function `{kind}(xs)` that returns {about}.", kind,
                [([xs], eval(body, {"xs": xs})) for xs in lists], f"def {kind}(xs):\n    return {body}\n")


def make_row(rng: random.Random) -> dict:
    return rng.choice([_arith, _strings, _lists])(rng)


def dataset(seed: int) -> Iterator[dict]:
    """An endless, seeded stream of coding rows."""
    rng = random.Random(seed)
    while True:
        yield make_row(rng)


def cases_of(row: dict) -> list[dict]:
    """The row's cases; an older row's `assert name(args) == expected` strings parsed into them
    (literals only: a test that is anything else raises ValueError, and the reward fails)."""
    if "cases" in row:
        return row["cases"]
    cases = []
    for test in row["tests"]:
        node = ast.parse(test).body[0]
        if not (isinstance(node, ast.Assert) and isinstance(node.test, ast.Compare)
                and isinstance(node.test.ops[0], ast.Eq) and len(node.test.ops) == 1
                and isinstance(node.test.left, ast.Call) and not node.test.left.keywords):
            raise ValueError(f"test {test!r} is not `assert {row['entry_point']}(literals) == literal`")
        cases.append({"args": [ast.literal_eval(a) for a in node.test.left.args],
                      "expected": ast.literal_eval(node.test.comparators[0])})
    return cases


# Runs in the sandbox. The model's prints go to stderr (fd 1 becomes a copy of 2) so that they
# cannot garble the results, which go to the original stdout. Nothing here needs to survive the
# model's code: whatever it does to this harness, it learns no expected value from it.
HARNESS = r'''
import json, os, sys
_results = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr
_PLAIN = (int, float, str, bool, type(None))
def _plain(v, depth=0):
    # exact types only: a subclass (an int whose __eq__ is always True) is not an int
    if type(v) in _PLAIN:
        return v
    if type(v) is list and depth < 20:
        return [_plain(x, depth + 1) for x in v]
    if type(v) is dict and depth < 20 and all(type(k) is str for k in v):
        return {k: _plain(x, depth + 1) for k, x in v.items()}
    raise TypeError("returned a " + type(v).__name__ + ", not a JSON value of exact built-in types")

# <params>
_space = {"__name__": "__main__"}
exec(compile(CODE, "<solution>", "exec"), _space)
_out = []
for _args in ARGS:
    try:
        _out.append({"value": _plain(_space[ENTRY](*_args))})
    except BaseException as e:
        _out.append({"error": type(e).__name__})
_results.write(json.dumps({"results": _out}))
_results.flush()
'''


def program(code: str, entry_point: str, args: list[list]) -> str:
    """The harness with the model's code, the function's name and each case's arguments (only
    those: the expected values stay here)."""
    params = f"CODE = {code!r}\nENTRY = {entry_point!r}\nARGS = json.loads({json.dumps(args)!r})\n"
    return HARNESS.replace("# <params>\n", params)


def same(value, expected) -> bool:
    """Equal, and of exactly the same types all the way down (1 is not True, nor 1.0)."""
    if type(value) is not type(expected):
        return False
    if isinstance(expected, list):
        return len(value) == len(expected) and all(map(same, value, expected))
    if isinstance(expected, dict):
        return value.keys() == expected.keys() and all(same(value[k], expected[k]) for k in expected)
    return value == expected


def returned(stdout: str, n: int) -> list[dict] | None:
    """The n results the harness wrote, or None: anything else on the channel is not a verdict."""
    try:
        doc = json.loads(stdout)
    except (ValueError, RecursionError):  # written by the code itself, nested too deep to parse
        return None
    results = doc.get("results") if type(doc) is dict and len(doc) == 1 else None
    if type(results) is not list or len(results) != n or not all(type(r) is dict for r in results):
        return None
    return results


def answer_code(completion: str) -> str:
    blocks = FENCE.findall(completion)
    return blocks[-1] if blocks else completion


async def reward(prompt: str, completion: str, row: dict) -> float:
    cases = cases_of(row)
    result = await SANDBOX.run(program(answer_code(completion), row["entry_point"], [c["args"] for c in cases]))
    return verdict(result, cases)


def verdict(result: RunResult, cases: list[dict]) -> float:
    """The share of cases whose returned value is the expected one, from a run that exited cleanly
    with exactly the harness's document on its channel; else 0. Each guard here and in the
    harness stops a forgery of its own (tests/tasks/test_coding_task.py removes each in turn)."""
    values = returned(result.stdout, len(cases)) if result.outcome == "ok" else None
    if values is None:
        return 0.0
    return sum(set(r) == {"value"} and same(r["value"], c["expected"]) for r, c in zip(values, cases)) / len(cases)


reward.bounds = (0.0, 1.0)  # outside it, a reward has failed: orchestrator/rewards/reward.py
