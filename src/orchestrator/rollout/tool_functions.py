"""Tools an environment gives the model: Python functions (sync or async), described to the chat
template by JSON schemas built from their signatures and docstrings, called with the arguments
the model wrote, under a timeout.

Whatever goes wrong in a call (an unknown name, missing or mistyped arguments, the function
raising or hanging) becomes the text of the tool message the model reads next and is counted as
a tool error: a tool never fails the episode, let alone the orchestrator (a picture it returns
that cannot be used does: orchestrator/rollout/turn_images.py). A sync tool runs on a
thread of its own pool (asyncio's default pool also serves the orchestrator's file writes); one
that hangs past its timeout is answered with an error but keeps its thread until it returns,
since Python cannot stop a thread: write tools that wait on I/O as async functions.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import types
import typing
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

from orchestrator.rollout.turn_images import content_of

JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array",
              dict: "object", type(None): "null"}
# What each JSON type accepts from json.loads (bool is an int in Python, not in JSON).
ACCEPTS = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
           "array": (list,), "object": (dict,), "null": (type(None),)}
SECTION = re.compile(r"^\s*(Args|Arguments|Parameters)\s*:\s*$")
PARAM_LINE = re.compile(r"^\s*(\*{0,2}\w+)\s*(\([^)]*\))?\s*:\s*(.*)$")
_pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="tool")


def json_schema(annotation, where: str) -> dict:
    """The JSON schema of a parameter annotation: str, int, float, bool, list[X], dict,
    Literal[...], X | None, unions."""
    if annotation in JSON_TYPES:
        return {"type": JSON_TYPES[annotation]}
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        kinds = sorted({JSON_TYPES[type(a)] for a in args})
        return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": list(args)}
    if origin in (list, tuple, set, frozenset):
        return {"type": "array", **({"items": json_schema(args[0], where)} if args and args[0] is not ... else {})}
    if origin is dict:
        return {"type": "object"}
    if origin in (typing.Union, types.UnionType):
        options = [json_schema(a, where) for a in args if a is not type(None)]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        return {**schema, "nullable": True} if type(None) in args else schema
    raise TypeError(f"{where}: cannot describe {annotation!r} in JSON (use str, int, float, bool, "
                    "list[...], dict, Literal[...] or a union of them)")


def docstring_parts(doc: str | None) -> tuple[str, dict[str, str]]:
    """(description, {parameter: description}) from a Google-style docstring: the text before an
    "Args:" section, then that section's "name (type): text" entries."""
    description, params, current = [], {}, None
    in_args = False
    for line in inspect.cleandoc(doc or "").splitlines():
        if SECTION.match(line):
            in_args = True
            continue
        if not in_args:
            description.append(line)
            continue
        m = PARAM_LINE.match(line)
        if m and not line.startswith("        "):
            current = m.group(1).lstrip("*")
            params[current] = m.group(3).strip()
        elif line.strip() and current and line.startswith(" "):
            params[current] = f"{params[current]} {line.strip()}".strip()
        elif line.strip():  # another section (Returns:, Raises:): the arguments are over
            in_args, current = False, None
    paragraphs = "\n".join(description).strip().split("\n\n")
    return " ".join(paragraphs[0].split()), params


@dataclass
class Tool:
    name: str
    fn: Callable
    schema: dict
    """As chat templates take it: {"type": "function", "function": {name, description, parameters}}."""

    @classmethod
    def from_function(cls, fn: Callable) -> Tool:
        name = getattr(fn, "__name__", None)
        if not callable(fn) or not name or name == "<lambda>":
            raise TypeError(f"tool {fn!r}: a tool is a named function (def or async def)")
        hints = typing.get_type_hints(fn)
        description, docs = docstring_parts(fn.__doc__)
        properties, required = {}, []
        for p in inspect.signature(fn).parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
                raise TypeError(f"tool {name}: parameter {p.name} must be passable by keyword (no *args, **kwargs, /)")
            if p.name not in hints:
                raise TypeError(f"tool {name}: parameter {p.name} needs a type annotation (its JSON schema)")
            properties[p.name] = json_schema(hints[p.name], f"tool {name}, parameter {p.name}")
            if p.name in docs:
                properties[p.name]["description"] = docs[p.name]
            if p.default is p.empty:
                required.append(p.name)
        parameters = {"type": "object", "properties": properties, "required": required}
        function = {"name": name, "description": description, "parameters": parameters}
        return cls(name, fn, {"type": "function", "function": function})

    def argument_error(self, arguments: Any) -> str | None:
        """Why these arguments cannot be passed, or None."""
        if not isinstance(arguments, dict):
            return f"arguments must be a JSON object, not {type(arguments).__name__}"
        spec = self.schema["function"]["parameters"]
        unknown = sorted(set(arguments) - set(spec["properties"]))
        if unknown:
            return f"unknown argument(s) {', '.join(unknown)}; {self.name} takes {', '.join(spec['properties']) or 'none'}"
        missing = [p for p in spec["required"] if p not in arguments]
        if missing:
            return f"missing required argument(s) {', '.join(missing)}"
        for key, value in arguments.items():
            if not matches(value, spec["properties"][key]):
                return f"argument {key}: {json.dumps(value)} is not {describe(spec['properties'][key])}"
        return None

    async def call(self, arguments: dict, timeout_s: float) -> str | list[dict]:
        """The tool's result as message content: its text, or OpenAI content parts when it is a
        picture (orchestrator/rollout/turn_images.py content_of); raises ToolError with what to
        tell the model."""
        why = self.argument_error(arguments)
        if why is not None:
            raise ToolError(f"{self.name}: {why}")
        try:
            async with asyncio.timeout(timeout_s):  # not wait_for: it can lose a cancel (orchestrator.bounded_wait)
                if inspect.iscoroutinefunction(self.fn):
                    result = await self.fn(**arguments)
                else:
                    result = await asyncio.get_running_loop().run_in_executor(_pool, lambda: self.fn(**arguments))
        except TimeoutError:
            raise ToolError(f"{self.name}: no result within {timeout_s:g} s") from None
        except Exception as e:
            raise ToolError(f"{self.name} raised {type(e).__name__}: {e}") from None
        content = content_of(result)
        if content is not None:
            return content
        try:
            return json.dumps(result, ensure_ascii=False)
        except (TypeError, ValueError):
            return str(result)


class ToolError(Exception):
    """A call that did not give a result; its text is what the model is told."""


def matches(value: Any, schema: dict) -> bool:
    if value is None and schema.get("nullable"):
        return True
    if "anyOf" in schema:
        return any(matches(value, s) for s in schema["anyOf"])
    if "enum" in schema:
        return value in schema["enum"]
    kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    ok = any(isinstance(value, ACCEPTS[k]) and not (k in ("integer", "number") and isinstance(value, bool))
             for k in kinds)
    if ok and "items" in schema:
        return all(matches(v, schema["items"]) for v in value)
    return ok


def describe(schema: dict) -> str:
    if "anyOf" in schema:
        return " or ".join(describe(s) for s in schema["anyOf"])
    if "enum" in schema:
        return "one of " + ", ".join(json.dumps(v) for v in schema["enum"])
    kind = schema["type"]
    if kind == "array" and "items" in schema and "type" in schema["items"]:
        return f"an array of {schema['items']['type']} values"
    return f"an {kind}" if kind in ("integer", "array", "object") else f"a {kind}"


def load_tools(functions, where: str) -> dict[str, Tool]:
    """An environment's `tools` (a list of functions) by name; TypeError naming `where`."""
    try:
        tools = [Tool.from_function(f) for f in functions]
    except TypeError as e:
        raise TypeError(f"{where}: {e}") from None
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise TypeError(f"{where}: two tools named {next(n for n in names if names.count(n) > 1)}")
    return {t.name: t for t in tools}
