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

A tool's result or the opening messages may hold pictures (orchestrator/rollout/turn_images.py):
their placeholders are expanded as the model's processor expands them, every later request
carries all the episode's pictures (the ids sent holding one placeholder each), and the
trajectory keeps them in placeholder order. A picture that cannot be used fails the episode.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import jinja2

from orchestrator.rendering import ChatTemplate, ImagePrompt, Opening, expand, row_messages, template_messages
from orchestrator.rollout.agent_images import AgentImages, image_positions
from orchestrator.rollout.tool_functions import Tool, ToolError
from orchestrator.rollout.turn_images import EpisodeImages, named_pictures, with_pictures
from orchestrator.rollout.tool_parsers import BadCall, ToolCall, ToolParser
from rl.inference_api import GeneratedSample

SampleTurn = Callable[[str, list[int], ImagePrompt | None], Awaitable[GeneratedSample]]
"""(request id, the episode's ids so far, its pictures and the ids sent or None) -> the model's next turn."""


def opening_messages(env, row: dict) -> list[dict]:
    """A tool environment's first messages (measured at start-up, orchestrator/rollout/tool_environment.py): its own messages(row) if it has one, else the row's
    prompt or messages after its system_prompt."""
    if hasattr(env, "messages"):
        return env.messages(row)
    return row_messages(row, "prompt", "messages", getattr(env, "system_prompt", "") or "")


def opening_measure(env, template: ChatTemplate, support, tools: list[dict] | None = None) -> Callable[[object], Opening]:
    """tokenizer -> row -> tokens of the environment's opening as the model reads it (the start-up
    room check, orchestrator/rendering/fit.py): its first messages through the chat template, with
    the tools' schemas, each picture's placeholder expanded as the model's processor expands it
    (`support`: image_support(model), None for a text model); None where the template or the
    row fails (at run time: that one rollout fails)."""
    def opening(tokenizer) -> Opening:
        def tokens(row: dict) -> int | None:
            try:
                text = template.render(opening_messages(env, row), True, tools)
            except (jinja2.TemplateError, KeyError):
                return None
            if support is not None:
                text = expand(support, text)
            return len(tokenizer.encode(text, add_special_tokens=False).ids)

        return tokens

    return opening


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
    images: list[bytes] = field(default_factory=list)
    """The pictures of the episode's turns, PNG, in the order of their placeholders."""

    def stats(self) -> dict[str, float]:
        return {"turns": self.turns, "tool_calls": self.tool_calls, "tool_errors": self.tool_errors,
                "tokens": self.tokens}


class ToolEpisode:
    """Runs episodes of one tool environment; `add(ids, sample)` is the trajectory's append."""

    def __init__(self, env, tools: dict[str, Tool], template: ChatTemplate, tokenizer, encode,
                 decode, parser: ToolParser, timeout_s: float, max_turns: int, seq_len: int,
                 images: AgentImages | None = None):
        self.env, self.tools, self.template = env, tools, template
        self.images = images or AgentImages(template, None, tokenizer)  # the model's pictures (none: text only)
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
        log = EpisodeLog(messages=with_pictures(self.first_messages(row)))
        pictures = EpisodeImages(self.images, self.encode)
        opening = pictures.decoded(image_positions(log.messages))
        tokens = pictures.keep(pictures.piece(self.template.render(template_messages(log.messages), True, self.schemas),
                                              opening))
        add(tokens)
        for turn in range(self.max_turns):
            sample = await sample_turn(f"{eid}-t{turn}", tokens, pictures.request(tokens))
            pictures.sampled(sample.token_ids)
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
            shown = pictures.decoded([p for r in replies for p in
                                      named_pictures(r["content"], f"turn {turn}: tool {r['name'] or '?'}")])
            between = pictures.piece(self.between_turns(log.messages, replies, sample.token_ids), shown)
            if len(tokens) + len(between.token_ids) >= self.seq_len or not pictures.readable(between):
                break  # no room for another model turn (or no way to send it: EpisodeImages.readable)
            log.messages += replies
            tokens = tokens + pictures.keep(between)
            add(between.token_ids)
        log.tokens, log.images = len(tokens), pictures.pngs
        return log

    async def answer(self, call: ToolCall | BadCall) -> tuple[str | list[dict], bool]:
        """(the tool message's content, whether the call failed)."""
        if isinstance(call, BadCall):
            return f"error: {call.error}", True
        tool = self.tools.get(call.name)
        if tool is None:
            return f"error: unknown tool {call.name!r}; the tools are {', '.join(self.tools)}", True
        try:
            return await tool.call(call.arguments, self.timeout_s), False
        except ToolError as e:
            return f"error: {e}", True

    def between_turns(self, conversation: list[dict], replies: list[dict], sampled: list[int]) -> str:
        """The text the template puts between the model's last token and its next turn (a
        picture in a reply: its placeholder)."""
        before = self.template.render(template_messages(conversation), False, self.schemas)
        after = self.template.render(template_messages(conversation + replies), True, self.schemas)
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
        return closing + after[len(before):]

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


def tool_message(call: ToolCall | BadCall, text: str | list[dict], turn: int, i: int) -> dict:
    name = call.name if isinstance(call, ToolCall) else ""
    return {"role": "tool", "tool_call_id": call_id(turn, i), "name": name, "content": text}


def call_id(turn: int, i: int) -> str:
    return f"call_{turn}_{i}"
