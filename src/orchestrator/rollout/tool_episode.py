"""One tool-calling episode: the chat template renders the conversation with the environment's
tools, the model answers, its tool calls are read (orchestrator/rollout/tool_parsers.py) and run
(orchestrator/rollout/tool_functions.py), their results go back as tool messages through the template, and the
model goes on, until it answers without a call, max_turns model turns, or seq_len.

Token fidelity: the trajectory is built by appending, never by re-rendering. The model's turns
are the very ids the server sampled; between two turns come the ids of the text the template
adds for the tool messages: render(conversation + tool messages, generation prompt) minus
render(conversation), after the end-of-turn token the model itself wrote. A template that
rewrites earlier turns when a message is added (e.g. one that drops past reasoning) cannot give
such a continuation: the episode fails naming it rather than train on ids the model never saw.

The trainer learns only from the model's ids (loss mask 1); the prompt, tool results and the
template's markup between turns are context (mask 0).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from orchestrator.rendering import ChatTemplate, row_messages
from orchestrator.rollout.tool_functions import Tool, ToolError
from orchestrator.rollout.tool_parsers import BadCall, ToolCall, ToolParser
from rl.inference_api import GeneratedSample

SampleTurn = Callable[[str, list[int]], Awaitable[GeneratedSample]]
"""(request id, the episode's ids so far) -> the model's next turn."""


def opening_messages(env, row: dict) -> list[dict]:
    """A tool environment's first messages (measured at start-up, orchestrator/rollout/tool_environment.py): its own messages(row) if it has one, else the row's
    prompt or messages after its system_prompt."""
    if hasattr(env, "messages"):
        return env.messages(row)
    return row_messages(row, "prompt", "messages", getattr(env, "system_prompt", "") or "")


class TemplateDrift(Exception):
    """The template's rendering of a longer conversation does not extend the shorter one's."""


@dataclass
class EpisodeLog:
    """What an episode did, for the per-step means ("episode/<name>" in metrics.jsonl)."""
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tokens: int = 0
    messages: list[dict] = field(default_factory=list)

    def stats(self) -> dict[str, float]:
        return {"turns": self.turns, "tool_calls": self.tool_calls, "tool_errors": self.tool_errors,
                "tokens": self.tokens}


class ToolEpisode:
    """Runs episodes of one tool environment; `add(ids, sample)` is the trajectory's append."""

    def __init__(self, env, tools: dict[str, Tool], template: ChatTemplate, tokenizer, encode,
                 decode, parser: ToolParser, timeout_s: float, max_turns: int, seq_len: int):
        self.env, self.tools, self.template = env, tools, template
        self.encode, self.decode, self.parser = encode, decode, parser
        self.timeout_s, self.max_turns, self.seq_len = timeout_s, max_turns, seq_len
        self.schemas = [t.schema for t in tools.values()]
        eot = template.end_of_turn(tokenizer)
        self.eot_id = eot[0] if eot else None
        self.eot_text = tokenizer.id_to_token(eot[0]) if eot else ""

    def first_messages(self, row: dict) -> list[dict]:
        """The environment's own messages(row) if it has one, else the row's prompt or messages
        (as the start-up check measured them: orchestrator/rendering/fit.py)."""
        return opening_messages(self.env, row)

    async def run(self, row: dict, eid: str, sample_turn: SampleTurn, add) -> EpisodeLog:
        """The episode's conversation, turn by turn, into `add`; returns its log."""
        log = EpisodeLog(messages=self.first_messages(row))
        tokens = self.encode(self.template.render(log.messages, True, self.schemas), add_special_tokens=False)
        add(tokens)
        for turn in range(self.max_turns):
            sample = await sample_turn(f"{eid}-t{turn}", tokens)
            tokens = tokens + sample.token_ids
            add(sample.token_ids, sample)
            log.turns += 1
            content, calls = self.parser.parse(self.decode(sample.token_ids))
            log.messages.append(assistant_message(content, calls, turn))
            if not calls or sample.finish_reason == "length" or turn == self.max_turns - 1:
                break  # (a call no model turn would read is not run)
            results = await asyncio.gather(*(self.answer(c) for c in calls))
            replies = [tool_message(call, text, turn, i) for i, (call, (text, _)) in enumerate(zip(calls, results))]
            log.tool_calls += len(calls)
            log.tool_errors += sum(failed for _, failed in results)
            between = self.between_turns(log.messages, replies, sample.token_ids)
            if len(tokens) + len(between) >= self.seq_len:
                break  # no room for another model turn
            log.messages += replies
            tokens = tokens + between
            add(between)
        log.tokens = len(tokens)
        return log

    async def answer(self, call: ToolCall | BadCall) -> tuple[str, bool]:
        """(the tool message's text, whether the call failed)."""
        if isinstance(call, BadCall):
            return f"error: {call.error}", True
        tool = self.tools.get(call.name)
        if tool is None:
            return f"error: unknown tool {call.name!r}; the tools are {', '.join(self.tools)}", True
        try:
            return await tool.call(call.arguments, self.timeout_s), False
        except ToolError as e:
            return f"error: {e}", True

    def between_turns(self, conversation: list[dict], replies: list[dict], sampled: list[int]) -> list[int]:
        """The ids the template puts between the model's last token and its next turn."""
        before = self.template.render(conversation, False, self.schemas)
        after = self.template.render(conversation + replies, True, self.schemas)
        if not after.startswith(before):
            raise TemplateDrift(f"the chat template ({self.template.origin}) renders the earlier turns "
                                "differently once a tool message follows: the ids trained on would not be "
                                "the ones the model saw")
        # The template closes the model's turn with its end-of-turn token and maybe more ("\n");
        # the model wrote that token itself, unless another stop token ended its turn.
        at = before.rfind(self.eot_text) if self.eot_text else -1
        closing = before[at + len(self.eot_text):] if at >= 0 else ""
        if self.eot_id is not None and sampled[-1:] != [self.eot_id]:
            closing = self.eot_text + closing
        return self.encode(closing + after[len(before):], add_special_tokens=False)

    async def reward(self, log: EpisodeLog, row: dict) -> float:
        value = self.env.reward(log.messages, row)
        if inspect.isawaitable(value):
            value = await value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{type(self.env).__name__}.reward returned {type(value).__name__}, not a number")
        return float(value)


def assistant_message(content: str, calls: list[ToolCall | BadCall], turn: int) -> dict:
    """The model's turn in OpenAI form (what a reward reads); unreadable calls are left out."""
    message = {"role": "assistant", "content": content}
    good = [(i, c) for i, c in enumerate(calls) if isinstance(c, ToolCall)]
    if good:
        message["tool_calls"] = [{"id": call_id(turn, i), "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for i, c in good]
    return message


def tool_message(call: ToolCall | BadCall, text: str, turn: int, i: int) -> dict:
    name = call.name if isinstance(call, ToolCall) else ""
    return {"role": "tool", "tool_call_id": call_id(turn, i), "name": name, "content": text}


def call_id(turn: int, i: int) -> str:
    return f"call_{turn}_{i}"
