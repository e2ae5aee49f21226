"""How tool calls are read from a model's text: one parser per format, chosen once by
`orchestrator.tools.parser` (a name below, or "module:Class" of your own with the same
`parse(text) -> list[ToolCall | BadCall]`).

hermes: the form Qwen 2.5/3, Hermes and many fine-tunes are trained on,

    <tool_call>
    {"name": "calculate", "arguments": {"expression": "2 + 3"}}
    </tool_call>

any number per turn. The model's answer text is what remains outside the tags.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Protocol

from orchestrator.callables import load_callable


@dataclass
class ToolCall:
    name: str
    arguments: Any
    """As the model wrote them; checked against the tool's schema when called (orchestrator/rollout/tool_functions.py)."""


@dataclass
class BadCall:
    """Text that tries to be a call but cannot be read as one: the model is told why."""
    error: str


class ToolParser(Protocol):
    def parse(self, text: str) -> tuple[str, list[ToolCall | BadCall]]:
        """(the text outside calls, the calls in the order written)."""


class HermesParser:
    CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str, list[ToolCall | BadCall]]:
        calls = [read_call(m.group(1), closed=m.group(0).endswith("</tool_call>"))
                 for m in self.CALL.finditer(text)]
        return self.CALL.sub("", text).strip(), calls


def read_call(body: str, closed: bool) -> ToolCall | BadCall:
    if not closed:
        return BadCall("malformed tool call: <tool_call> without </tool_call>")
    try:
        call = json.loads(body)
    except ValueError as e:
        return BadCall(f"malformed tool call: not JSON ({e})")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return BadCall('malformed tool call: expected {"name": <tool name>, "arguments": {...}}')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError as e:
            return BadCall(f"malformed tool call to {call['name']}: arguments are not JSON ({e})")
    return ToolCall(call["name"], arguments)


PARSERS = {"hermes": HermesParser}


def tool_parser(spec: str) -> ToolParser:
    """The parser `orchestrator.tools.parser` names."""
    if spec in PARSERS:
        return PARSERS[spec]()
    return load_callable(spec, "orchestrator.tools.parser")()
