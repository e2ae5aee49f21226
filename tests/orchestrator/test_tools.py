"""Tools as an environment declares them (orchestrator/rollout/tool_functions.py) and tool calls as a model writes them
(orchestrator/rollout/tool_parsers.py): schemas from signatures and docstrings, argument checks, calls that raise,
hang or return objects, and every malformed call the Hermes parser must turn into a message."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Literal

import pytest

from orchestrator.rollout.tool_parsers import BadCall, HermesParser, ToolCall
from orchestrator.rollout.tool_functions import Tool, ToolError, load_tools


def calculate(expression: str, precision: int = 2) -> str:
    """Evaluate an arithmetic expression.

    More detail that is not the summary.

    Args:
        expression: Integers with + - * / and parentheses,
            e.g. "(2 + 3) * 4".
        precision (int): Digits after the point.

    Returns:
        The value, as text.
    """
    return f"{eval(expression, {'__builtins__': {}}):.{precision}f}"  # test input only


async def lookup(key: Literal["a", "b"], tags: list[str] | None = None) -> dict:
    """Look a key up."""
    await asyncio.sleep(0)
    return {"key": key, "tags": tags or []}


def boom(x: float) -> str:
    """Always fails."""
    raise RuntimeError(f"cannot handle {x}")


def slow(seconds: float) -> str:
    """Sleeps."""
    time.sleep(seconds)
    return "done"


async def slow_async(seconds: float) -> str:
    """Sleeps, awaiting."""
    await asyncio.sleep(seconds)
    return "done"


def test_schema_from_signature_and_docstring():
    schema = Tool.from_function(calculate).schema
    assert schema == {"type": "function", "function": {
        "name": "calculate", "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {
            "expression": {"type": "string",
                           "description": 'Integers with + - * / and parentheses, e.g. "(2 + 3) * 4".'},
            "precision": {"type": "integer", "description": "Digits after the point."}},
            "required": ["expression"]}}}
    params = Tool.from_function(lookup).schema["function"]["parameters"]
    assert params["properties"] == {"key": {"type": "string", "enum": ["a", "b"]},
                                    "tags": {"type": "array", "items": {"type": "string"}, "nullable": True}}
    assert params["required"] == ["key"]


@pytest.mark.parametrize("fn, says", [
    (lambda x: x, "a named function"),
    (lambda: None, "a named function"),
])
def test_what_cannot_be_a_tool_is_named(fn, says):
    with pytest.raises(TypeError, match=says):
        Tool.from_function(fn)


def test_unannotated_parameters_and_duplicate_names_are_refused():
    def f(x):
        """No annotation."""

    with pytest.raises(TypeError, match="env: tool f: parameter x needs a type annotation"):
        load_tools([f], "env")
    with pytest.raises(TypeError, match="env: two tools named calculate"):
        load_tools([calculate, calculate], "env")


def call(tool_fn, arguments, timeout_s: float = 5.0):
    async def main():
        try:
            return await Tool.from_function(tool_fn).call(arguments, timeout_s)
        except ToolError as e:
            return e
    return asyncio.run(main())


def test_calls_return_text_and_json():
    assert call(calculate, {"expression": "2 + 3"}) == "5.00"
    assert json.loads(call(lookup, {"key": "b", "tags": None})) == {"key": "b", "tags": []}
    assert json.loads(call(lookup, {"key": "a", "tags": ["x"]})) == {"key": "a", "tags": ["x"]}


@pytest.mark.parametrize("fn, arguments, message", [
    (calculate, {}, "calculate: missing required argument(s) expression"),
    (calculate, {"expression": 5}, "calculate: argument expression: 5 is not a string"),
    (calculate, {"expression": "1", "precision": 1.5}, "argument precision: 1.5 is not an integer"),
    (calculate, {"expression": "1", "precision": True}, "argument precision: true is not an integer"),
    (calculate, {"expr": "1"}, "unknown argument(s) expr; calculate takes expression, precision"),
    (calculate, ["1"], "arguments must be a JSON object, not list"),
    (lookup, {"key": "c"}, 'argument key: "c" is not one of "a", "b"'),
    (lookup, {"key": "a", "tags": [1]}, "argument tags: [1] is not an array of string values"),
    (boom, {"x": 1}, "boom raised RuntimeError: cannot handle 1"),
])
def test_bad_calls_become_errors_naming_the_problem(fn, arguments, message):
    out = call(fn, arguments)
    assert isinstance(out, ToolError) and message in str(out), out


@pytest.mark.parametrize("fn", [slow, slow_async])
def test_a_hanging_tool_is_answered_at_its_timeout(fn):
    start = time.monotonic()
    out = call(fn, {"seconds": 3.0}, timeout_s=0.3)
    took = time.monotonic() - start
    # The timeout's error, not the tool's "done": answered before the tool returned (the order
    # shows in the answer itself), and not before the timeout.
    assert isinstance(out, ToolError) and "no result within 0.3 s" in str(out)
    assert took >= 0.3, took
    assert call(fn, {"seconds": 0.01}, timeout_s=5) == "done"


def test_an_int_is_a_number():
    assert call(boom, {"x": 2}).args[0] == "boom raised RuntimeError: cannot handle 2"


def test_hermes_parser_reads_several_calls_and_the_text_around_them():
    text = ('Let me compute.\n<tool_call>\n{"name": "calculate", "arguments": {"expression": "2+3"}}\n</tool_call>\n'
            '<tool_call>{"name": "lookup", "arguments": "{\\"key\\": \\"a\\"}"}</tool_call>')
    content, calls = HermesParser().parse(text)
    assert content == "Let me compute."
    assert calls == [ToolCall("calculate", {"expression": "2+3"}), ToolCall("lookup", {"key": "a"})]
    assert HermesParser().parse("The answer is 5.") == ("The answer is 5.", [])


@pytest.mark.parametrize("text, error", [
    ('<tool_call>{"name": "calculate", "arguments": {</tool_call>', "malformed tool call: not JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', 'expected {"name": <tool name>'),
    ('<tool_call>["calculate"]</tool_call>', 'expected {"name": <tool name>'),
    ('<tool_call>{"name": "f", "arguments": "{oops"}</tool_call>', "malformed tool call to f: arguments are not JSON"),
    ('<tool_call>{"name": "calculate", "arguments": {}}', "<tool_call> without </tool_call>"),
])
def test_hermes_parser_turns_malformed_calls_into_errors(text, error):
    _, calls = HermesParser().parse(text)
    assert len(calls) == 1 and isinstance(calls[0], BadCall) and error in calls[0].error, calls
