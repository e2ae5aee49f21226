"""The OpenAI chat endpoint an external agent talks to (orchestrator/rollout/agent_environment.py): one
aiohttp server in the orchestrator, on loopback, that answers `POST /v1/chat/completions` for
every running episode. The episode is named by the API key the agent's client sends (a secret
made per episode); each request is

1. rendered by the model's chat template (messages and `tools`, the generation prompt), as the
   built-in tool loop renders it; a request with `image_url` parts (data: URLs) is rendered with
   the model's processor's placeholder expansion and sent with its pictures
   (orchestrator/rollout/agent_images.py), and the engine's expansion must be the trainer's;
2. sampled through the episode's own `generate` (the scheduler's: the group's server, its
   request ids recorded so a stale group is aborted there, per-token versions and logprobs),
   with the run's sampling settings (orchestrator.sampling.temperature, top_p, ...): the agent's own are
   ignored, since the trainer recomputes the policy under the run's; its `max_tokens` (or
   `max_completion_tokens`) is honoured up to orchestrator.sampling.max_tokens;
3. recorded in the episode's order (prompt ids, the sampled GeneratedSample, the pictures), from which the
   trajectory is rebuilt without re-tokenising what the model wrote; a request that leaves no
   room within seq_len is answered empty with finish_reason "length" (nothing sampled), as the
   built-in tool loop ends such an episode;
4. answered as OpenAI does: the text, tool calls read by orchestrator.tools.parser
   (`message.tool_calls`, arguments as a JSON string, finish_reason "tool_calls"), usage.

Refused with one line (OpenAI's error shape): an unknown key (401), a body that is not a chat
request, `stream`, `n` > 1 (400). A picture that cannot be used (unreadable, not a data: URL, a
decompression bomb, too many, a text-only model) is refused (400) naming the part, and fails its
episode whatever the agent does next (`AgentEpisode.failure`): a conversation the model did not
see as the agent meant it is not trained on.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from dataclasses import dataclass, field

from aiohttp import web

from orchestrator.prompts import RowError
from orchestrator.rendering import ChatTemplate, ImageError, ImagePrompt, check_expanded, has_images
from orchestrator.rollout.agent_images import AgentImages
from orchestrator.rollout.kind import Aborted, Generate
from orchestrator.rollout.tool_parsers import ToolCall, ToolParser
from rl.config.datasets import Sampling
from rl.inference_api import GeneratedSample


@dataclass
class AgentEpisode:
    """One running episode: where its requests go, and what they sampled."""
    eid: str
    generate: Generate
    turns: list[tuple[list[int], GeneratedSample, list[bytes]]] = field(default_factory=list)
    """Per request: its prompt ids (placeholders expanded), what was sampled, its pictures (PNG,
    in placeholder order)."""
    aborted: bool = False
    out_of_room: bool = False
    """A request found no room left within seq_len (answered empty, finish_reason "length")."""
    failure: str = ""
    """Why the episode fails whatever its agent does next (a refused picture), else ""."""

    def refuse(self, status: int, message: str) -> RequestError:
        self.failure = self.failure or message
        return RequestError(status, message)


class RequestError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class AgentEndpoint:
    def __init__(self, template: ChatTemplate, encode, decode, parser: ToolParser, request, sampling: Sampling,
                 model_name: str, images: AgentImages | None = None):
        self.template, self.encode, self.decode, self.parser = template, encode, decode, parser
        self.images = images or AgentImages(template, None, None)
        self.request, self.sampling, self.model_name = request, sampling, model_name
        self.episodes: dict[str, AgentEpisode] = {}
        self.runner: web.AppRunner | None = None
        self.starting = asyncio.Lock()
        self.base_url = ""

    async def start(self) -> None:
        """Listening on 127.0.0.1, a port the system picks (base_url says which); the first
        episode starts it, the others wait for that."""
        async with self.starting:
            if self.runner is None:
                await self.listen()

    async def listen(self) -> None:
        app = web.Application(client_max_size=16 * 2**20)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.base_url = f"http://127.0.0.1:{self.runner.addresses[0][1]}/v1"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    def open(self, eid: str, generate: Generate) -> tuple[str, AgentEpisode]:
        """A new episode's key (the agent's API key) and its record."""
        key = f"episode-{secrets.token_urlsafe(24)}"
        self.episodes[key] = AgentEpisode(eid, generate)
        return key, self.episodes[key]

    def close(self, key: str) -> None:
        self.episodes.pop(key, None)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model_name, "object": "model"}]})

    async def chat(self, request: web.Request) -> web.Response:
        key = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        episode = self.episodes.get(key)
        try:
            if episode is None:
                raise RequestError(401, "unknown API key: each episode's agent gets its own (it may have ended)")
            try:
                body = await request.json()
            except ValueError as e:
                raise RequestError(400, f"body: not valid JSON ({e})") from None
            return web.json_response(await self.answer(episode, body))
        except RequestError as e:
            return web.json_response({"error": {"message": str(e), "type": "invalid_request_error"}}, status=e.status)

    async def answer(self, episode: AgentEpisode, body: dict) -> dict:
        if episode.failure:
            raise RequestError(400, f"the episode has failed: {episode.failure}")
        messages, tools = self.checked(body)
        turn = len(episode.turns)
        ids, pictures = self.prompt(episode, turn, messages, tools)
        limit = body.get("max_completion_tokens") or body.get("max_tokens") or self.sampling.max_tokens
        sampling = self.sampling.model_copy(update={"max_tokens": max(1, min(int(limit), self.sampling.max_tokens))})
        try:
            wanted = self.request(f"{episode.eid}-r{turn}", ids, 1, sampling, f"episode {episode.eid}'s request {turn}",
                                  images=pictures)
        except RowError:
            # No room left within seq_len: an empty answer cut at its length, as the built-in
            # tool loop ends such an episode; the agent's loop sees no call and ends too.
            episode.out_of_room = True
            return self.reply(episode, turn, len(ids), "", [], "length", 0)
        try:
            response = await episode.generate(wanted)
            sample = response.samples[0]
        except Aborted:
            sample = None
        if sample is None or sample.finish_reason == "abort":
            episode.aborted = True  # the group was cancelled (stale) or its server is going down
            raise RequestError(503, "the episode was cancelled")
        if pictures is not None:
            try:  # the prompt the engine sampled after must be the one the trainer scores
                check_expanded(pictures, response.prompt_token_ids, f"request {turn}")
            except ImageError as e:
                raise episode.refuse(502, str(e)) from None
        episode.turns.append((ids, sample, pictures.images if pictures is not None else []))
        return self.completion(episode, turn, ids, sample)

    def prompt(self, episode: AgentEpisode, turn: int, messages: list[dict], tools: list[dict]
               ) -> tuple[list[int], ImagePrompt | None]:
        """The request's prompt ids as the trainer sees them, and its pictures (None without)."""
        try:
            if has_images(messages):
                pictures = self.images.prompt(messages, tools or None)
                return pictures.token_ids, pictures
            text = self.template.render(messages, True, tools or None)
        except ImageError as e:
            raise episode.refuse(400, f"request {turn}: {e}") from None
        except Exception as e:  # jinja2.TemplateError and the template's own bugs
            raise RequestError(400, f"messages: the chat template ({self.template.origin}) fails on them: {e}") from None
        return self.encode(text, add_special_tokens=False), None

    def checked(self, body: dict) -> tuple[list[dict], list[dict]]:
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list) or not body["messages"]:
            raise RequestError(400, "messages: a non-empty list of chat messages is required")
        if body.get("stream"):
            raise RequestError(400, "stream: streamed answers are not offered to agents; set stream to false")
        if body.get("n", 1) != 1:
            raise RequestError(400, f"n: one completion per request (got {body['n']}): the group's episodes are the samples")
        tools = body.get("tools") or []
        if not isinstance(tools, list):
            raise RequestError(400, "tools: a list of tool schemas is expected")
        return body["messages"], tools

    def completion(self, episode: AgentEpisode, turn: int, ids: list[int], sample: GeneratedSample) -> dict:
        content, calls = self.parser.parse(self.decode(sample.token_ids))
        good = [c for c in calls if isinstance(c, ToolCall)]
        finish = "tool_calls" if good else "length" if sample.finish_reason == "length" else "stop"
        return self.reply(episode, turn, len(ids), content, good, finish, len(sample.token_ids))

    def reply(self, episode: AgentEpisode, turn: int, prompt_tokens: int, content: str, good: list[ToolCall],
              finish: str, completion_tokens: int) -> dict:
        message: dict = {"role": "assistant", "content": content}
        if good:
            message["tool_calls"] = [
                {"id": f"call_{turn}_{i}", "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments if isinstance(c.arguments, str)
                              else json.dumps(c.arguments)}} for i, c in enumerate(good)]
        return {"id": f"chatcmpl-{episode.eid}-{turn}", "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name, "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens}}
