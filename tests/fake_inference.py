"""A stand-in inference server speaking rl/inference_api.py, whose timing the test dictates.

Real vLLM cannot be told "this request takes 40 ms, that one 2 s", which the staleness property
tests need; tests/inference/test_inference_server.py and tests/integration/test_end_to_end.py cover the same routes on
real vLLM. Generation is simulated token by token (all n samples of a request decode in lockstep,
as in a batched engine), each token tagged with the version serving when it was "sampled";
/update_weights honours the two modes like the real server: "wait" lets running requests finish
on the old version first, "keep" swaps between two tokens. The server keeps a record of what
happened (versions over time, aborts) for the test to check against. Faults on demand: a server
down, a share of requests answered with HTTP 500 or left hanging until aborted, rewards that
raise or hang.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from conftest import TINY_MODEL, free_port
from rl.config import RunConfig
from rl.heartbeat import current_instance
from rl.inference_api import InferenceClient, connector
from tasks.reverse import ALPHABET


LETTER_IDS = range(3, 29)  # the tiny model's char vocabulary: a-z
EOS = 1
HANG_S = 3600.0  # a decode step of a hanging request: only an abort ends it in a test's time


def row_name(index: int) -> str:
    """A dataset row index spelt in letters (the tiny tokenizer knows no digits)."""
    name = ""
    while True:
        name = ALPHABET[index % 26] + name
        index //= 26
        if index == 0:
            return name


def dataset(seed: int) -> Iterator[dict]:
    i = 0
    while True:
        yield {"prompt": row_name(i) + "=", "index": i}
        i += 1


def reward(prompt: str, completion: str, row: dict) -> float:
    return random.random()


def coin_reward(prompt: str, completion: str, row: dict) -> float:
    """0 or 1: a group of two agrees half the time (zero variance)."""
    return float(random.random() < 0.5)


def flaky_reward(prompt: str, completion: str, row: dict) -> float:
    if random.random() < 0.3:
        raise RuntimeError("reward service hiccup")
    return random.random()


FAULT_SHARE = 0.4
_decided: set[str] = set()
_decided_lock = threading.Lock()
faulted: list[str] = []
"""Prompts whose scoring fault_once chose to fail."""
release_hung_rewards = threading.Event()
"""Set by a test once done: lets the threads of hung sync rewards go (nothing else can stop them)."""


def reset_faults() -> None:
    with _decided_lock:
        _decided.clear()
        faulted.clear()
    release_hung_rewards.clear()


def fault_once(prompt: str) -> bool:
    """True on the first scoring of FAULT_SHARE of the prompts, never again for them: the group's
    retry then passes, so no prompt is dropped after MAX_ATTEMPTS failed groups and a test can
    still demand that none is lost. (With groups of two, about FAULT_SHARE / 2 of the calls.)"""
    with _decided_lock:
        if prompt in _decided:
            return False
        _decided.add(prompt)
        if random.random() >= FAULT_SHARE:
            return False
        faulted.append(prompt)
        return True


def raising_reward(prompt: str, completion: str, row: dict) -> float:
    if fault_once(prompt):
        raise RuntimeError("reward service hiccup")
    return random.random()


def hanging_reward(prompt: str, completion: str, row: dict) -> float:
    if fault_once(prompt):
        release_hung_rewards.wait()
    return random.random()


async def hanging_async_reward(prompt: str, completion: str, row: dict) -> float:
    if fault_once(prompt):
        await asyncio.Event().wait()  # only a cancellation ends it
    return random.random()


@dataclass
class Record:
    prompt: list[int]
    n: int
    started: float
    finished: float | None = None
    aborted_at: float | None = None
    tokens: int = 0
    abort: asyncio.Event = field(default_factory=asyncio.Event)
    stop_token_ids: list[int] = field(default_factory=list)


@dataclass
class FakeServer:
    token_latency: Callable[[], float] = lambda: 0.0
    """Seconds per decode step of one request (drawn once per request: a slow request is slow
    throughout, like a long rollout)."""
    update_latency: float = 0.0
    version: int = 0
    down: bool = False
    error_rate: float = 0.0
    """Share of /generate requests answered with HTTP 500."""
    hang_rate: float = 0.0
    """Share of /generate requests that generate nothing until aborted (a stuck engine request)."""
    lengths: Callable[[], int] | None = None
    """Drawn per sample: it stops ("stop", as at eos) after that many tokens if below max_tokens.
    None: every sample runs to max_tokens ("length")."""
    errors: list[float] = field(default_factory=list)
    """When each HTTP 500 was sent."""
    hung: set[str] = field(default_factory=set)
    """Ids of the requests left hanging."""
    versions: list[tuple[float, int]] = field(default_factory=lambda: [(time.monotonic(), 0)])
    requests: dict[str, Record] = field(default_factory=dict)
    aborted: set[str] = field(default_factory=set)
    running: int = 0
    updates: int = 0
    instance: str | None = None
    """The instance /health names; None: this process's heartbeat's, as the real server's."""

    def __post_init__(self):
        self.admit = asyncio.Event()  # cleared while an update holds new requests back
        self.admit.set()
        self.decode = asyncio.Event()  # cleared while a "keep" update swaps weights mid-decode
        self.decode.set()
        self.lock = asyncio.Lock()
        self.idle = asyncio.Event()
        self.idle.set()
        self.rng = random.Random(0)
        self.faults = random.Random(1)  # apart from rng: tokens stay as they were without faults

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/abort", self.abort)
        app.router.add_post("/update_weights", self.update_weights)
        return app

    async def health(self, request: web.Request) -> web.Response:
        if self.down:
            return web.json_response({"error": "down"}, status=503)
        # As the real server: the instance its process's heartbeat names (a test that announces
        # the stand-in starts a Heartbeat in its own process), so the pool takes it as announced.
        return web.json_response({"status": "ok", "version": self.version, "path": "", "running": self.running,
                                  "instance": self.instance or current_instance()})

    async def generate(self, request: web.Request) -> web.Response:
        if self.down:
            return web.json_response({"error": "down"}, status=503)
        body = await request.json()
        rid, n = body["request_id"], body.get("n", 1)
        if self.error_rate and self.faults.random() < self.error_rate:
            self.errors.append(time.monotonic())
            return web.json_response({"error": "engine failed"}, status=500)
        await self.admit.wait()
        rec = self.requests[rid] = Record(body["prompt_token_ids"], n, time.monotonic(),
                                          stop_token_ids=body.get("stop_token_ids") or [])
        self.running += 1
        self.idle.clear()
        if self.hang_rate and self.faults.random() < self.hang_rate:
            self.hung.add(rid)
            step_s = HANG_S
        else:
            step_s = self.token_latency()
        samples = [{"token_ids": [], "logprobs": [], "versions": [], "finish_reason": "length"} for _ in range(n)]
        stops = [self.lengths() if self.lengths else None for _ in range(n)]
        try:
            for _ in range(body.get("max_tokens", 16)):
                if step_s:
                    try:  # a decode step, cut short by an abort
                        await asyncio.wait_for(rec.abort.wait(), step_s)
                    except TimeoutError:
                        pass
                await self.decode.wait()
                if rid in self.aborted:
                    for s in samples:
                        s["finish_reason"] = "abort"
                    break
                for s, stop in zip(samples, stops):
                    if s["finish_reason"] == "stop":
                        continue
                    token = self.rng.choice(LETTER_IDS)
                    s["token_ids"].append(token)
                    s["logprobs"].append(-3.2)
                    s["versions"].append(self.version)
                    if len(s["token_ids"]) == stop:
                        s["finish_reason"] = "stop"
                rec.tokens += 1
        finally:
            rec.finished = time.monotonic()
            self.running -= 1
            if self.running == 0:
                self.idle.set()
        prompt_logprobs = None
        if body.get("prompt_logprobs"):
            prompt_logprobs = [None] + [-0.5] * (len(body["prompt_token_ids"]) - 1)
        return web.json_response({"samples": samples, "prompt_logprobs": prompt_logprobs})

    async def abort(self, request: web.Request) -> web.Response:
        ids = [i for i in (await request.json())["request_ids"] if i in self.requests]
        for i in ids:
            if self.requests[i].finished is None:
                self.requests[i].aborted_at = time.monotonic()
            self.requests[i].abort.set()
            self.aborted.add(i)
        return web.json_response({"aborted": len(ids)})

    async def update_weights(self, request: web.Request) -> web.Response:
        if self.down:
            return web.json_response({"error": "down"}, status=503)
        body = await request.json()
        async with self.lock:
            self.admit.clear()
            try:
                if body.get("mode", "wait") == "wait":
                    await self.idle.wait()
                else:
                    self.decode.clear()
                await asyncio.sleep(self.update_latency)
                self.version = body["version"]
                self.versions.append((time.monotonic(), self.version))
                self.updates += 1
            finally:
                self.decode.set()
                self.admit.set()
        return web.json_response({"version": self.version, "reload_s": self.update_latency})


async def score_over_http(handler, timeout_s: float, prompt: str, completions: list[str], row: dict,
                          release: asyncio.Event | None = None) -> list:
    """Scores from orchestrator.scoring.Reward pointed at a one-route reward server running
    `handler` (an aiohttp handler for POST /score). `release`: set once scored, before the
    server shuts down (which waits for handlers still hanging on it)."""
    import aiohttp
    from rl.inference_api import connector

    from orchestrator.rewards.registry import make_reward

    app = web.Application()
    app.router.add_post("/score", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with aiohttp.ClientSession(connector=connector()) as session:
            return await make_reward(f"http://127.0.0.1:{port}/score", timeout_s, session).score(prompt, completions, row)
    finally:
        if release is not None:
            release.set()
        await runner.cleanup()


async def start(server: FakeServer, port: int) -> web.AppRunner:
    runner = web.AppRunner(server.app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


def tiny_config(**orchestrator) -> RunConfig:
    """The tiny model's run config with these [orchestrator] settings."""
    return RunConfig.model_validate({"model": str(TINY_MODEL), "seq_len": 64, "orchestrator": orchestrator})


async def with_server(server: FakeServer, body):
    """`body(client, session)` against `server` on a free port (an InferenceClient of ours)."""
    port = free_port()
    runner = await start(server, port)
    try:
        async with aiohttp.ClientSession(connector=connector()) as session:
            client = InferenceClient(f"http://127.0.0.1:{port}", session)
            return await body(client, session)
    finally:
        await runner.cleanup()


if __name__ == "__main__":  # a null server for benchmarks/orchestrator_throughput.py
    import sys

    async def serve(port: int) -> None:
        await start(FakeServer(), port)
        await asyncio.Event().wait()

    asyncio.run(serve(int(sys.argv[1])))
