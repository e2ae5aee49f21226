"""Calculator: a tool-calling environment. The model is asked a reasoning-gym "basic_arithmetic"
question ("Calculate -9*-9-7.") that a tiny model cannot work out in its head, but can by
copying the expression into the `calculate` tool and the tool's result into its answer.

    [orchestrator.environment]
    class = "tasks.calculator:Calculator"
    max_turns = 3

One episode: user question -> assistant turn with a <tool_call> -> tool message with the result
-> assistant's final answer (its last message's content), scored by reasoning-gym's own
`score_answer` (1.0 for the exact answer; a text merely containing it gets len(answer)/len(text)).

Rows: reasoning_gym.create_dataset(TASK, seed=seed, **TASK_KWARGS); its row idx is drawn from
Random(seed + idx), so rows of seeds s and s' overlap when their index ranges meet. A dataset
cycles through RL_ROWS rows, so RL runs with seed <= 1000 stay clear of the held-out rows (seed
EVAL_SEED, EVAL_ROWS rows), which scripts/make_tool_model.py measures the model on; its SFT rows
come from seed SFT_SEED, far from both.
"""

from __future__ import annotations

import ast
import functools
import math
import operator
import random
from collections.abc import Iterator
from fractions import Fraction

TASK = "basic_arithmetic"
# Short questions: 2-3 terms of 1-2 digits (negative numbers, parentheses and unary minus
# included), no division (reasoning-gym's "/" is floor division, a calculator's is not), no spaces
# ("-9*-9-7", not "-9 * -9 - 7"): half the tokens to copy, and no run of look-alike " " tokens
# to lose one's place in (a 0.84M model learnt to copy these within ~1000 SFT steps, and had not
# learnt to copy the spaced ones after 600).
TASK_KWARGS = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2,
               "operators": ["+", "-", "*"], "whitespace": "no_space"}
RL_ROWS = 9_000
EVAL_SEED, EVAL_ROWS = 10_000, 100
SFT_SEED = 1_000_000
SFT_ROWS = 100_000   # made on demand: configs/sft_tiny_tool.toml reads 30000
DIRECT_FRACTION = 0.4

MAX_EXPRESSION = 200  # characters; also bounds the size of the numbers a product can reach
BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The expression to evaluate.
    """
    if not isinstance(expression, str):
        raise ValueError("the expression must be a string")
    if len(expression) > MAX_EXPRESSION:
        raise ValueError(f"expression longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from e
    value = _evaluate(tree.body)
    try:
        return str(value.numerator) if value.denominator == 1 else repr(float(value))
    except (OverflowError, ValueError) as e:  # past float's range, or an int of > 4300 digits
        raise ValueError(f"result too large: {e}") from None


def _evaluate(node: ast.AST) -> Fraction:
    """Numbers, + - * /, unary - and +, parentheses (absent from the tree); nothing else."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        if not math.isfinite(node.value):
            raise ValueError(f"not a finite number: {ast.unparse(node)}")
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ValueError("division by zero")
        return BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
        return UNARY[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"unsupported in an arithmetic expression: {ast.unparse(node)!r}")


@functools.cache
def task_dataset(seed: int, size: int):
    import reasoning_gym

    return reasoning_gym.create_dataset(TASK, size=size, seed=seed, **TASK_KWARGS)


def row(entry: dict) -> dict:
    return {"prompt": entry["question"], "answer": entry["answer"], "metadata": entry["metadata"]}


def rows(seed: int, size: int) -> list[dict]:
    """Rows 0..size-1 of `seed` (e.g. the held-out ones: rows(EVAL_SEED, EVAL_ROWS))."""
    return [row(e) for e in task_dataset(seed, size)]


def final_answer(messages: list[dict]) -> str:
    """The last assistant message's content, stripped ("" if there is none)."""
    last = next((m for m in reversed(messages) if m.get("role") == "assistant"), None)
    return ((last or {}).get("content") or "").strip()


class Calculator:
    tools = [calculate]

    def dataset(self, seed: int) -> Iterator[dict]:
        data = task_dataset(seed, RL_ROWS)
        while True:  # endless: the same RL_ROWS rows again
            for entry in data:
                yield row(entry)

    def reward(self, messages: list[dict], row: dict) -> float:
        entry = {"question": row["prompt"], "answer": row["answer"], "metadata": row["metadata"]}
        return float(task_dataset(EVAL_SEED, 1).score_answer(final_answer(messages), entry))


def sft_conversation(row: dict, direct: bool = False) -> list[dict]:
    """A row as a supervised conversation: the call, the tool's result, the answer; or (direct)
    the answer at once, without the tool."""
    user = {"role": "user", "content": row["prompt"]}
    if direct:
        return [user, {"role": "assistant", "content": row["answer"]}]
    expression = row["metadata"]["expression"]
    call = {"type": "function", "function": {"name": "calculate", "arguments": {"expression": expression}}}
    return [user, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "calculate", "content": calculate(expression)},
            {"role": "assistant", "content": row["answer"]}]


def sft_rows(seed: int) -> Iterator[dict]:
    """models/tiny-tool's SFT rows (configs/sft_tiny_tool.toml): seed SFT_SEED's questions, each
    a conversation with the tool's schema. DIRECT_FRACTION of them (drawn from Random(seed)) answer
    at once, without the tool: the model cannot work the answer out, so these mostly teach it wrong
    guesses; sampling at T=1 it then calls the tool only part of the time, which RL can teach it to
    do always."""
    rng = random.Random(seed)
    for entry in task_dataset(SFT_SEED, SFT_ROWS):
        yield {"messages": sft_conversation(row(entry), direct=rng.random() < DIRECT_FRACTION), "tools": _schemas()}


def heldout_sft_rows(seed: int) -> Iterator[dict]:
    """The held-out rows (EVAL_SEED) as tool conversations: rl sft's held-out loss."""
    for entry in task_dataset(EVAL_SEED, EVAL_ROWS):
        yield {"messages": sft_conversation(row(entry)), "tools": _schemas()}


def _schemas() -> list[dict]:
    from orchestrator.rollout.tool_functions import Tool

    return [Tool.from_function(f).schema for f in Calculator.tools]
