"""The inference server's HTTP surface as the orchestrator uses it: request bodies (validated by
the server with these same models), the table of routes and an aiohttp client.

Generation is token-in, token-out (`POST /generate`): the orchestrator sends token ids and gets
token ids, the sampled tokens' logprobs and, per token, the policy version that sampled it. Text
round trips would re-tokenize completions differently from how they were sampled, which corrupts
multi-turn episodes and the trainer's logprob ratios. vLLM's OpenAI routes stay available for
people; the run does not depend on them.

The routes are listed once, in ROUTES (path, method, request and response models, one line on
what each does): the server (inference/routes.py) registers its handlers from it and
InferenceClient calls it from it, so neither can name a route or a body the other does not know.

A GenerateRequest naming `lora` samples with that adapter on the base weights; every token's
version is the version the adapter was loaded as.

With a token (inference.api_token, else the environment variable ASYNCRL_API_TOKEN) every route but
/health and a few read-only probes needs `Authorization: Bearer <token>`, vLLM's own included.
Request bodies with unknown fields are refused.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Literal

import aiohttp
from pydantic import BaseModel, ConfigDict, Field

TOKEN_ENV = "ASYNCRL_API_TOKEN"
# Policy versions and broadcast ranks: far beyond any real run, and within every integer type
# they reach (torch's process groups take ranks as C ints).
MAX_INT = 2**31 - 1


def resolve_token(configured: str | None) -> str | None:
    """The bearer token: inference.api_token if set, else $ASYNCRL_API_TOKEN (which keeps it out of
    config files and command lines); None or empty: no token."""
    return configured or os.environ.get(TOKEN_ENV) or None


class Body(BaseModel):
    # A misspelt optional field would otherwise be dropped silently and its default used.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class GenerateRequest(Body):
    request_id: str = Field(min_length=1, max_length=200)
    prompt_token_ids: list[int] = Field(min_length=1)
    n: int = Field(1, ge=1, le=1024)
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    """-1: off."""
    min_p: float = Field(0.0, ge=0, le=1)
    stop: list[str] = Field([], max_length=32)
    """Strings that end a completion; its token ids still include every token sampled."""
    stop_token_ids: list[int] = []
    prompt_logprobs: bool = False
    """Also return the logprob of every prompt token (a teacher scoring a student's tokens)."""
    lora: str | None = None
    """Name of a loaded adapter (POST /load_lora_adapter) to sample with; None: base weights."""
    kept_sets: bool = False
    """Also return each sampled token's kept set: the ids the sampler kept after min_p, top_k
    and top_p (inference/kept_sets.py); refused when it may exceed the server's max_logprobs."""
    routed_experts: bool = False
    """Also return the experts each MoE layer routed every token to (inference/routing_capture.py);
    refused by a server that does not record them (inference.record_routing)."""
    images: list[str] = Field([], max_length=16)
    """Base64 image files (PNG), in the order of the prompt's image placeholders: one placeholder
    token per image in prompt_token_ids, which the model's processor in the server expands
    (orchestrator/rendering/images.py, inference/multimodal.py)."""


def kept_set_bound(top_k: int, vocab: int) -> int:
    """How many processed logprobs per token hold a whole kept set (inference/kept_sets.py): top_k
    + 1 when top_k is on (the extra one shows where the set ends), else the whole vocabulary.
    Checked by the server per request and by the orchestrator at start-up."""
    return min(vocab, top_k + 1) if 0 < top_k < vocab else vocab


class RoutedExperts(BaseModel):
    """Which experts each MoE layer sent each position of prompt + completion to: `positions` rows
    of [layers, top_k] expert ids (in the router's order, not sorted), row-major, base64."""

    layers: list[int]
    """The model's MoE layers (decoder layer indices), in the rows' order."""
    top_k: int
    dtype: Literal["uint8", "uint16"]
    positions: int
    """Rows: every position the engine ran a forward on, so prompt + completion less the last
    sampled token (never fed forward)."""
    data: str
    missing: list[int] = []
    """Positions with no row (a prompt token the engine did not recompute): replay falls back there."""

    def array(self):
        """The rows as a numpy array [positions, layers, top_k]."""
        import base64

        import numpy as np

        flat = np.frombuffer(base64.b64decode(self.data), dtype=self.dtype)
        return flat.reshape(self.positions, len(self.layers), self.top_k)


class GeneratedSample(BaseModel):
    token_ids: list[int]
    logprobs: list[float]
    """Logprob of each sampled token under the (temperature-scaled) distribution it came from."""
    versions: list[int]
    """Policy version that sampled each token."""
    finish_reason: Literal["stop", "length", "abort"]
    kept: list[list[int]] | None = None
    """With kept_sets: per sampled token, the ids the sampler kept (ascending); [] where the set
    could not be read whole (ties past top_k)."""
    routed_experts: RoutedExperts | None = None
    """With routed_experts: this sample's routing (None for a sample aborted before it ran)."""


class GenerateResponse(BaseModel):
    samples: list[GeneratedSample]
    prompt_token_ids: list[int] | None = None
    """With images: the prompt the engine sampled after, its placeholders expanded (the ids the
    trainer must see; the orchestrator checks them against its own expansion)."""
    prompt_logprobs: list[float | None] | None = None
    """With prompt_logprobs: one per prompt token, None for the first (nothing predicts it)."""


class AbortRequest(Body):
    request_ids: list[str]


class UpdateWeightsRequest(Body):
    path: str = Field(min_length=1)
    """weights/step_<n> relative to the server's output_dir (hosts mount the shared directory
    where they like), "base" for the model it started with, or an absolute path."""
    version: int = Field(ge=0, le=MAX_INT)
    mode: Literal["wait", "keep"] = "wait"


ADAPTER_NAME = r"^[A-Za-z0-9_.@-]+$"


class LoadLoRARequest(Body):
    name: str = Field(min_length=1, max_length=100, pattern=ADAPTER_NAME)
    path: str = Field(min_length=1)
    """A directory holding adapter_config.json and adapter_model.safetensors (peft's
    save_pretrained), under output_dir/weights/ or output_dir/runs/<run>/weights/."""
    version: int = Field(ge=0, le=MAX_INT)
    """Policy version of the adapter: every token sampled with it carries this version."""


class UnloadLoRARequest(Body):
    name: str = Field(min_length=1, max_length=100, pattern=ADAPTER_NAME)


class InitBroadcasterRequest(Body):
    address: str = Field(min_length=1)
    """weight_sync.address (host:port of the trainer's rendezvous store); the server accepts only
    its own configured one."""
    rank_offset: int = Field(ge=1, le=MAX_INT)
    """Rank of this server's first worker (rank 0 is trainer rank 0)."""
    world_size: int = Field(ge=2, le=MAX_INT)
    """Trainer rank 0 plus every worker of every server."""


@dataclass(frozen=True)
class Route:
    """One route of the inference server, as the server registers it and the client calls it."""

    method: Literal["GET", "POST"]
    path: str
    request: type[Body] | None
    """The JSON body; None: the route takes none."""
    response: type[BaseModel] | None
    """The answer's model; None: a small JSON object, whose keys `about` names."""
    about: str
    """What the route does and answers, in one line."""


# Keyed by name: the server's handler and the client's method are both called this.
ROUTES: dict[str, Route] = {
    "health": Route(
        "GET", "/health", None, None,
        'engine health, the version now serving, its path, the engine requests running and those an '
        '/abort stopped while they ran, since start, and the instance its heartbeat names: {"status", "version", '
        '"path", "running", "aborted", "instance"}, and '
        'with trainer.lora.rank > 0 "adapters": {name: version}; 503 while a reload outlives '
        'inference.timeouts.reload_s'),
    "generate": Route(
        "POST", "/generate", GenerateRequest, GenerateResponse,
        "token ids in, token ids + logprobs + per-token policy versions out; the n samples are engine "
        'requests "<request_id>-<i>", so /abort can reach them'),
    "abort": Route(
        "POST", "/abort", AbortRequest, None,
        'abort the engine requests of those /generate calls: {"aborted": how many calls}'),
    "update_weights": Route(
        "POST", "/update_weights", UpdateWeightsRequest, None,
        'load the weights in path as version; mode "wait" lets running requests finish on the old weights '
        'first, "keep" swaps them between two decode steps (later tokens carry the new version); answers '
        'once the new weights serve: {"version", "reload_s", "switched"}'),
    "init_broadcaster": Route(
        "POST", "/init_broadcaster", InitBroadcasterRequest, None,
        "the server's workers join the trainer's weight broadcast group (rl/weights/broadcast.py) as ranks "
        "rank_offset.. rank_offset+workers-1, after which a path holding broadcast.json is received from "
        'the trainer; answers once the group is formed: {"address", "ranks", "world_size", "already"}'),
    "broadcaster": Route(
        "GET", "/broadcaster", None, None,
        'ranks the server takes in a broadcast group, and the group it joined (null before '
        '/init_broadcaster): {"workers", "group"}'),
    "load_lora_adapter": Route(
        "POST", "/load_lora_adapter", LoadLoRARequest, None,
        "(trainer.lora.rank > 0) load the peft adapter in path as name; the same name, path and version "
        "again is a no-op, a name loaded from another path or version is 409, as is a load past "
        'inference.max_loras: {"name", "version", "load_s", "already"}'),
    "unload_lora_adapter": Route(
        "POST", "/unload_lora_adapter", UnloadLoRARequest, None,
        'drop an adapter; 409 while a /generate uses it: {"name", "version"}'),
}


class InferenceError(Exception):
    """A call to an inference server that failed; the message names the server and the route."""


# vLLM's HTTP server closes a keep-alive connection idle for 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE);
# aiohttp keeps them 15 s, and a request written to one the server has just closed fails before
# it is sent ("Can not write request body"). Measured: the first /update_weights after a 0.5B
# model's 5 s write failed that way and the server left rotation. Drop them first.
KEEPALIVE_S = 3.0


def connector(limit: int = 100) -> aiohttp.TCPConnector:
    """Connection pool for clients of our servers."""
    return aiohttp.TCPConnector(limit=limit, keepalive_timeout=KEEPALIVE_S)


class InferenceClient:
    """One inference server. aiohttp rather than httpx: the orchestrator's request rate is bound
    by the client's per-request overhead, which is ~20x lower in aiohttp."""

    def __init__(self, url: str, session: aiohttp.ClientSession, token: str | None = None):
        self.url = url.rstrip("/")
        self.session = session
        token = resolve_token(token)
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}

    async def call(self, name: str, timeout: float, body: Body | None = None):
        """The route ROUTES[name]; its response model, else the JSON object it answered."""
        route = ROUTES[name]
        assert isinstance(body, route.request or type(None)), (name, body)
        # A response model parses the bytes itself: a /generate answer of 64 x 8k tokens is 15 MB
        # of JSON, 0.24 s of the orchestrator's CPU this way, 0.39 s through json.loads and then
        # validation (docs/performance.md, "Real size").
        parse = json.loads if route.response is None else route.response.model_validate_json
        return await self._request(route.method, route.path, timeout,
                                   None if body is None else body.model_dump(), parse)

    async def _request(self, method: str, route: str, timeout: float, body: dict | None, parse):
        try:
            async with self.session.request(
                method, f"{self.url}{route}", json=body, headers=self.headers,
                timeout=aiohttp.ClientTimeout(total=timeout),
            ) as r:
                if r.status != 200:
                    text = await r.text()
                    raise InferenceError(f"{self.url}{route}: HTTP {r.status}: {text[:300]}")
                answer = await r.read()
        except TimeoutError:
            raise InferenceError(f"{self.url}{route}: no answer in {timeout:g} s (server down or "
                                 "unreachable?)") from None
        except aiohttp.ClientError as e:
            raise InferenceError(f"{self.url}{route}: {type(e).__name__}: {e}") from None
        try:
            return parse(answer)
        except ValueError as e:  # not JSON, or not the route's answer: the server's fault, like a cut connection
            raise InferenceError(f"{self.url}{route}: a bad answer: {str(e).splitlines()[0][:200]}") from None

    async def health(self, timeout: float = 5.0) -> dict:
        return await self.call("health", timeout)

    async def update_weights(self, path: str, version: int, mode: str, timeout: float) -> dict:
        return await self.call("update_weights", timeout, UpdateWeightsRequest(path=path, version=version, mode=mode))

    async def broadcaster(self, timeout: float = 10.0) -> dict:
        return await self.call("broadcaster", timeout)

    async def init_broadcaster(self, address: str, rank_offset: int, world_size: int, timeout: float) -> dict:
        body = InitBroadcasterRequest(address=address, rank_offset=rank_offset, world_size=world_size)
        return await self.call("init_broadcaster", timeout, body)

    async def load_lora_adapter(self, name: str, path: str, version: int, timeout: float) -> dict:
        return await self.call("load_lora_adapter", timeout, LoadLoRARequest(name=name, path=path, version=version))

    async def unload_lora_adapter(self, name: str, timeout: float = 30.0) -> dict:
        return await self.call("unload_lora_adapter", timeout, UnloadLoRARequest(name=name))

    async def generate(self, request: GenerateRequest, timeout: float) -> GenerateResponse:
        return await self.call("generate", timeout, request)

    async def abort(self, request_ids: list[str], timeout: float = 10.0) -> dict:
        return await self.call("abort", timeout, AbortRequest(request_ids=request_ids))
